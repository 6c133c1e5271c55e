"""The step recorder in SGLang's scheduler (``DPBOARD_STEP_LOG=DIR``): every batch a DP rank runs.

Three hooks on ``sglang.srt.managers.scheduler.Scheduler``, registered with SGLang's
``HookRegistry`` by plugin.py only when ``DPBOARD_STEP_LOG`` is set in a process that has loaded the
scheduler module:

- ``__init__`` (AROUND): checks the setting first (a bad ``DPBOARD_STEP_LOG`` stops the scheduler at
  its start, with a message naming it), then opens the rank's ``StepLog`` once SGLang's own
  ``__init__`` has sized the rank (its settings go into the log's header). Only the scheduler that is
  rank zero of its DP group records (pipeline, attention-TP and attention-CP rank 0: the one that
  holds the rank's load writer), so a DP rank has one log whatever its TP size.
- ``run_batch`` (AROUND): the step's start (``time.monotonic_ns()`` before SGLang's ``run_batch``),
  and once it returns, its launch time and the batch's numbers (below) into a pending row, under
  SGLang's own step number (``batch.forward_iter``, which ``run_batch`` sets from ``forward_ct``).
- ``process_batch_result`` (AFTER): the step's end: its duration and its row into the log.

**What a step's duration covers.** With the normal loop (``event_loop_normal``, and the disaggregation
loops alike), ``run_batch`` then ``process_batch_result`` of the same batch: the launch, the forward,
and the result's processing (the device's sync is in it). With the overlap scheduler
(``event_loop_overlap``, SGLang's default) a batch's result is processed after the *next* batch is
scheduled and launched, so its duration runs from its own launch to its result processed, across
the next launch: consecutive durations overlap, and a step whose next one began before it ended is
flagged ``overlapped``. ``dpboard steps`` counts each stretch of time once (``reader.step_times``).
Each step also records ``launch_ns``: from its start until SGLang's ``run_batch`` returned, taken
before the batch's numbers are read. On a GPU that is the launch alone; on a device that computes
in the scheduler's thread (a CPU) ``run_batch`` returns after the forward, so it is the step's whole
forward, and it lies inside the previous step's duration (the next batch is launched before a
result is processed). ``dpboard steps`` and the simulator's calibration (both through
``reader.step_times``) move each launch to its own step, so that on such a device every step is
given its own forward rather than the next one's.

**The batch's numbers** (ScheduleBatch, SGLang 0.5.23), read after ``run_batch`` returned:

- ``extend``: ``extend_num_tokens`` new tokens over ``len(reqs)`` requests, ``sum(prefix_lens)``
  tokens already in KV (prefix-cache hits and earlier chunks);
- ``decode``: ``len(reqs)`` requests of ``seq_lens_sum`` context tokens (the decode token included;
  ``int(seq_lens_cpu.sum())`` where SGLang left the sum unset);
- ``mixed`` (chunked prefill mixed with the running batch, ``mix_with_running``): the requests
  after the new ones are ``decoding_reqs``, each one token; their ``prefix_lens`` plus one each are
  their context;
- ``idle`` (DP attention: a rank with nothing to run steps with its group): zeros;
- an ``extend`` whose ``decoding_reqs`` are all its requests is SGLang's ``convert_decode_to_extend``
  (DP attention: a decode batch run as an extend because another rank of the group extends): a
  ``decode`` with the flag ``decode_as_extend``;
- with DP attention, ``group_extend`` is ``is_extend_in_batch``: the group's step was an extend step;
- any other forward mode (speculative verify, PD's prebuilt, split prefill, diffusion) is
  ``other``, with its ``extend_num_tokens``.

An exception in a hook is the recorder's: counted (the log's prelude), logged at the 1st, 10th,
100th... time, the step goes on unrecorded (StepLog.fault); SGLang's call and its result are
untouched. The hot path allocates nothing beyond the ints it reads and takes no lock (writer.py).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from typing import Any

from dpboard.steplog import format as fmt
from dpboard.steplog.settings import ENV_STEP_LOG, StepLogSettings, step_log_settings
from dpboard.steplog.writer import StepLog

log = logging.getLogger("dpboard.sglang")

SCHEDULER = "sglang.srt.managers.scheduler"
STATE = "_dpboard_steps"  # the scheduler's attribute holding its SGLangSteps (None: this one records nothing)
ENV_METHOD = "DPBOARD_METHOD"
_MODE_NAMES = {"EXTEND": fmt.EXTEND, "DECODE": fmt.DECODE, "MIXED": fmt.MIXED, "IDLE": fmt.IDLE}
_now = time.monotonic_ns


def wanted(environ: Any = None) -> bool:
    """Whether the environment asks for step logs (its value is checked when a scheduler starts)."""
    return bool((os.environ if environ is None else environ).get(ENV_STEP_LOG, "").strip())


def register(registry: Any, hook_type: Any, scheduler_module: str = SCHEDULER) -> None:
    """The three hooks, with SGLang's ``HookRegistry`` (plugin.py calls this)."""
    target = f"{scheduler_module}.Scheduler"
    registry.register(f"{target}.__init__", open_with_scheduler, hook_type.AROUND)
    registry.register(f"{target}.run_batch", record_launch, hook_type.AROUND)
    registry.register(f"{target}.process_batch_result", record_result, hook_type.AFTER)


# -- the hooks ----------------------------------------------------------------------------------------


def open_with_scheduler(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.__init__``: a bad setting stops the scheduler before it loads its model;
    once SGLang's ``__init__`` is done, the rank's log opens (never failing the scheduler)."""
    settings = step_log_settings()  # InvalidInputError naming DPBOARD_STEP_LOG: the scheduler does not start
    result = original(scheduler, *args, **kwargs)
    scheduler.__dict__[STATE] = None
    if settings is not None:
        try:
            scheduler.__dict__[STATE] = open_steps(scheduler, settings)
        except Exception:
            log.exception("dpboard: the step log could not be opened in %s; this scheduler records no steps "
                          "and serves on", settings.directory)
    return result


def record_launch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.run_batch``: the step's start, its launch time and the batch's numbers."""
    steps = scheduler.__dict__.get(STATE)
    if steps is None:
        return original(scheduler, batch, *args, **kwargs)
    t0 = _now()
    result = original(scheduler, batch, *args, **kwargs)
    launch_ns = _now() - t0  # before the batch's numbers are read: the launch alone (a CPU: the forward)
    try:
        steps.launched(batch, t0, launch_ns)
    except Exception as e:
        steps.fault(scheduler, e, "run_batch")
    return result


def record_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.process_batch_result``: the step's end. Returns None: SGLang's result stays."""
    steps = scheduler.__dict__.get(STATE)
    if steps is not None:
        try:
            steps.log.end(batch.forward_iter, _now())
        except Exception as e:
            steps.fault(scheduler, e, "process_batch_result")
    return None


# -- the recorder ----------------------------------------------------------------------------------------


class SGLangSteps:
    """One scheduler's recorder: its StepLog and what it learnt of SGLang's forward modes."""

    def __init__(self, step_log: StepLog, *, dp_attention: bool) -> None:
        self.log = step_log
        self.dp_attention = bool(dp_attention)
        self._modes: dict[Any, tuple[int, int]] = {}  # SGLang's ForwardMode member -> (mode, raw value)

    def _mode(self, forward_mode: Any) -> tuple[int, int]:
        known = self._modes.get(forward_mode)
        if known is None:
            name = getattr(forward_mode, "name", None)
            if name is None:
                raise TypeError(f"the batch's forward_mode is {forward_mode!r}, not one of SGLang's ForwardMode")
            raw = int(forward_mode) if isinstance(forward_mode, int) else 0
            known = self._modes[forward_mode] = (_MODE_NAMES.get(name, fmt.OTHER), raw & 0xFF)
        return known

    def launched(self, batch: Any, t0: int, launch_ns: int = 0) -> None:
        """The batch's numbers (the module's docstring) and ``launch_ns`` (from ``t0`` until ``run_batch``
        returned), into the step's pending row."""
        mode, raw = self._mode(batch.forward_mode)
        reqs = batch.reqs
        bs = len(reqs)
        flags = fmt.GROUP_EXTEND if self.dp_attention and batch.is_extend_in_batch else 0
        prefix = ctx = prefill = prefill_reqs = decode_reqs = 0
        if mode == fmt.DECODE:
            decode_reqs = bs
            ctx = batch.seq_lens_sum
            if ctx is None:
                ctx = _context_sum(batch)
        elif mode == fmt.EXTEND:
            decoding = batch.decoding_reqs
            if decoding is not None and len(decoding) == bs and bs:
                mode, flags = fmt.DECODE, flags | fmt.DECODE_AS_EXTEND  # convert_decode_to_extend
                decode_reqs = bs
                ctx = sum(batch.prefix_lens) + bs
            else:
                prefill, prefill_reqs, prefix = batch.extend_num_tokens, bs, sum(batch.prefix_lens)
        elif mode == fmt.MIXED:
            decoding = batch.decoding_reqs
            decode_reqs = len(decoding) if decoding is not None else 0
            prefill_reqs = bs - decode_reqs
            lens = batch.prefix_lens
            everything = sum(lens)
            prefix = sum(lens[:prefill_reqs])
            ctx = everything - prefix + decode_reqs
            prefill = batch.extend_num_tokens - decode_reqs
        elif mode == fmt.OTHER:
            prefill = batch.extend_num_tokens or 0
        self.log.begin(batch.forward_iter, t0, prefix, ctx, prefill, prefill_reqs, decode_reqs, decode_reqs, bs,
                       mode, flags, raw, launch_ns)

    def fault(self, scheduler: Any, error: BaseException, where: str) -> None:
        if self.log.fault(error, f"SGLang's Scheduler.{where}"):
            scheduler.__dict__[STATE] = None
            self.log.close()


def _context_sum(batch: Any) -> int:
    lens = batch.seq_lens_cpu
    if lens is not None:
        return int(lens.sum())
    return sum(req.seqlen for req in batch.reqs)


# -- opening -------------------------------------------------------------------------------------------------


def _read(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name``; ``default`` when it is missing or SGLang's context cannot say (it raises)."""
    try:
        value = getattr(obj, name)
    except Exception:  # noqa: BLE001 - SGLang's runtime context raises for what is not published
        return default
    return default if value is None else value


def _plain(value: Any) -> Any:
    """A JSON value for the header: numbers, text and booleans as they are, anything else as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def open_steps(scheduler: Any, settings: StepLogSettings) -> SGLangSteps | None:
    """The rank's recorder, or None for a scheduler that is not rank zero of its DP group."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if any(_read(parallel, name, 0) != 0 for name in ("pp_rank", "attn_tp_rank", "attn_cp_rank")):
        return None
    dp_attention = bool(_read(parallel, "attn_dp_enabled", False))
    rank = _read(parallel, "dp_rank")
    if rank is None:
        rank = _read(parallel, "attn_dp_rank", 0) if dp_attention else 0
    server_args = getattr(scheduler, "server_args", None)
    method = os.environ.get(ENV_METHOD, "").strip()
    chunk = _read(scheduler, "chunked_prefill_size", 0)
    settings_doc = {
        "chunked_prefill_size": chunk if isinstance(chunk, int) and chunk > 0 else 0,
        "max_running_requests": _read(scheduler, "max_running_requests"),
        "max_total_tokens": _read(scheduler, "max_total_num_tokens"),
        "overlap": bool(_read(scheduler, "enable_overlap", False)),
        "dp_attention": dp_attention,
        "method": method or _read(parallel, "load_balance_method") or _read(server_args, "load_balance_method"),
        "dispatch": "dpboard" if method else "sglang",
        "dp_size": _read(parallel, "num_dp_ranks"),
        "tp_size": _read(parallel, "tp_size"),
        "max_prefill_tokens": _read(scheduler, "max_prefill_tokens"),
        "server_chunked_prefill_size": _read(server_args, "chunked_prefill_size"),
        "mixed_chunk": _read(scheduler, "is_mixed_chunk"),
        "page_size": _read(scheduler, "page_size"),
        "schedule_policy": _read(scheduler, "schedule_policy"),
    }
    header = {"engine_version": _version(), "tp_rank": _read(parallel, "tp_rank", 0),
              "settings": {k: _plain(v) for k, v in settings_doc.items()}}
    step_log = StepLog(settings.directory, engine="sglang", rank=int(rank), header=header,
                       max_bytes=settings.max_bytes)
    log.info("dpboard: the scheduler of DP rank %d records its steps in %s", rank, step_log.path)
    return SGLangSteps(step_log, dp_attention=dp_attention)


def _version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
