"""The step recorder in vLLM's engine core (``DPBOARD_STEP_LOG=DIR``): every step its scheduler schedules.

plugin.py's ``register()`` checks the setting (a bad ``DPBOARD_STEP_LOG`` stops vLLM there, in every
process, with a message naming it) and, where it is set, ``patch`` wraps two methods of
``EngineCoreProc`` (``DPEngineCoreProc`` inherits them): ``_process_engine_step``, whose first call
opens the engine core's ``StepLog`` (its DP rank from ``settings.engine_slot``, its settings in the
header) and wraps its scheduler's ``schedule`` and ``update_from_output`` on that one instance; and
``shutdown``, which closes the log (vLLM forks its engine cores, whose exit runs no ``atexit``).

**A step** is one ``SchedulerOutput``: it starts when ``schedule()`` is called and ends when
``update_from_output()`` of that output returns. With ``EngineCore.step`` that is the whole step
(schedule, the model's forward and sampling, the output's processing); with the batch queue
(``step_with_batch_queue``: async scheduling, pipeline parallelism) an output's result is processed
after the next one is scheduled and launched, so durations overlap and the earlier step is flagged
``overlapped`` (``dpboard steps`` counts each stretch of time once). An idle MoE engine's dummy
batches (``DPEngineCoreProc``) schedule nothing and are not steps here. ``launch_ns`` is 0: not recorded.

**Its numbers**, from the ``SchedulerOutput`` alone (vLLM 0.32 and 0.33 have the same fields):

- a new request (``scheduled_new_reqs``) prefills ``num_scheduled_tokens[req_id]`` tokens, after its
  ``num_computed_tokens`` (its prefix-cache hits); with vLLM's v2 model runner a request resumed after
  a preemption comes back among these too, computing again;
- a cached request (``scheduled_cached_reqs``) with no output token yet (``num_output_tokens`` 0: a
  prefill chunk) or resumed after a preemption (``resumed_req_ids``: it computes again) prefills too,
  after its ``num_computed_tokens``; any other decodes its scheduled tokens (one, more with
  speculative decoding) on a context of ``num_computed_tokens`` plus those;
- the mode: ``mixed`` when a step has both, ``extend`` or ``decode`` when it has one, ``idle`` when
  it schedules nothing; the batch size is the number of requests scheduled.

A step whose cached requests are all decoding (the common case) is summed without a Python loop over
them (``0 in num_output_tokens``, ``sum(num_computed_tokens)``); a loop runs over the new requests, and
over the cached ones only in a step with a prefill chunk or a resumed request among them.

An exception in the recorder is never vLLM's: counted in the log's prelude, logged at the 1st, 10th,
100th... time (StepLog.fault), the step goes on as vLLM's. One that opens the log is logged once and
that engine core records nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from dpboard.integrations.vllm.settings import ENV_METHOD, engine_slot
from dpboard.steplog import format as fmt
from dpboard.steplog.settings import ENV_STEP_LOG, StepLogSettings, step_log_settings
from dpboard.steplog.writer import StepLog

log = logging.getLogger("dpboard.vllm")

STATE = "_dpboard_steps"  # the engine core's attribute holding its VllmSteps (None: records nothing)
_PENDING_OUTPUTS = 64  # outputs scheduled and not yet updated, at most (the batch queue holds a few)
_now = time.monotonic_ns


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get(ENV_STEP_LOG, "").strip())


def check(environ: Mapping[str, str] = os.environ) -> StepLogSettings | None:
    """The step log's settings; an InvalidInputError naming the variable when they are bad."""
    return step_log_settings(environ)


def patch(cls: type) -> None:
    """Wrap ``cls._process_engine_step`` (the log opens at the first step) and ``cls.shutdown`` (it
    closes), once."""
    if getattr(cls, "_dpboard_steps_patched", False):
        return
    original_step = cls._process_engine_step
    original_shutdown = cls.shutdown

    def _process_engine_step(self: Any) -> bool:
        if STATE not in self.__dict__:
            open_for_engine(self)
        return original_step(self)

    def shutdown(self: Any) -> None:
        close_for_engine(self)
        return original_shutdown(self)

    cls._process_engine_step = _process_engine_step
    cls.shutdown = shutdown
    cls._dpboard_steps_patched = True


def open_for_engine(engine: Any, environ: Mapping[str, str] = os.environ) -> None:
    """The engine core's recorder, its scheduler's two methods wrapped; None on the engine when the
    environment asks for none or the log cannot be opened (said once: vLLM serves on)."""
    engine.__dict__[STATE] = None
    try:
        settings = step_log_settings(environ)
        if settings is None:
            return
        steps = VllmSteps(open_log(engine, settings, environ), engine.scheduler)
        steps.install()
        engine.__dict__[STATE] = steps
    except Exception:
        log.exception("dpboard: the engine core's step log could not be opened; it records no steps and serves on")


def close_for_engine(engine: Any) -> None:
    steps = engine.__dict__.get(STATE)
    engine.__dict__[STATE] = None
    if isinstance(steps, VllmSteps):
        steps.uninstall()
        steps.log.close()


class VllmSteps:
    """One engine core's recorder: its StepLog, and its scheduler's ``schedule`` and
    ``update_from_output`` wrapped on the instance."""

    def __init__(self, step_log: StepLog, scheduler: Any) -> None:
        self.log = step_log
        self.scheduler = scheduler
        self.count = 0  # outputs scheduled: the step numbers
        self._pending: dict[int, int] = {}  # id(scheduler output) -> its step, until it is updated
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        scheduler = self.scheduler
        schedule, update = scheduler.schedule, scheduler.update_from_output
        self._originals = {"schedule": schedule, "update_from_output": update}

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            output = schedule(*args, **kwargs)
            try:
                self.scheduled(output, t0)
            except Exception as e:
                self.fault(e, "Scheduler.schedule")
            return output

        def timed_update_from_output(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = update(scheduler_output, *args, **kwargs)
            try:
                step = self._pending.pop(id(scheduler_output), None)
                if step is None:
                    self.log.unmatched += 1
                else:
                    self.log.end(step, _now())
            except Exception as e:
                self.fault(e, "Scheduler.update_from_output")
            return result

        scheduler.schedule = timed_schedule
        scheduler.update_from_output = timed_update_from_output

    def uninstall(self) -> None:
        for name in self._originals:
            self.scheduler.__dict__.pop(name, None)  # the class's methods again
        self._originals = {}

    def scheduled(self, output: Any, t0: int) -> None:
        """The output's numbers (the module's docstring), into the step's pending row."""
        step = self.count
        self.count = step + 1
        pending = self._pending
        if len(pending) >= _PENDING_OUTPUTS:  # outputs never updated (an error in vLLM's step): forget them
            self.log.unmatched += len(pending)
            pending.clear()
        pending[id(output)] = step
        scheduled = output.num_scheduled_tokens
        total = output.total_num_scheduled_tokens
        prefill = prefill_reqs = prefix = decode_reqs = decode_tokens = ctx = 0
        for new in output.scheduled_new_reqs:
            prefill += scheduled.get(new.req_id, 0)
            prefill_reqs += 1
            prefix += new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        ids = cached.req_ids
        if ids:
            computed, outputs, resumed = cached.num_computed_tokens, cached.num_output_tokens, cached.resumed_req_ids
            if not resumed and 0 not in outputs:  # every cached request decodes
                decode_reqs = len(ids)
                decode_tokens = total - prefill
                ctx = sum(computed) + decode_tokens
            else:
                for i, req_id in enumerate(ids):
                    n = scheduled.get(req_id, 0)
                    if outputs[i] == 0 or req_id in resumed:
                        prefill += n
                        prefill_reqs += 1
                        prefix += computed[i]
                    else:
                        decode_reqs += 1
                        decode_tokens += n
                        ctx += computed[i] + n
        if prefill and decode_reqs:
            mode = fmt.MIXED
        elif prefill:
            mode = fmt.EXTEND
        elif decode_reqs:
            mode = fmt.DECODE
        else:
            mode = fmt.IDLE
        self.log.begin(step, t0, prefix, ctx, prefill, prefill_reqs, decode_reqs, decode_tokens, len(scheduled), mode)

    def fault(self, error: BaseException, where: str) -> None:
        if self.log.fault(error, f"vLLM's {where}"):
            self.uninstall()
            self.log.close()


def open_log(engine: Any, settings: StepLogSettings, environ: Mapping[str, str] = os.environ) -> StepLog:
    """The engine core's StepLog, its header holding the engine's settings."""
    from dpboard.integrations.vllm.engine_core import capacity_tokens, lockstep_section
    from dpboard.integrations.vllm.versions import vllm_version

    config = engine.vllm_config
    scheduler_config = config.scheduler_config
    rank, dp_size = engine_slot(config.parallel_config)
    chunked = bool(getattr(scheduler_config, "enable_chunked_prefill", True))
    budget = getattr(scheduler_config, "max_num_batched_tokens", 0) or 0
    method = environ.get(ENV_METHOD, "").strip()
    lockstep = lockstep_section(config)
    settings_doc = {
        "chunked_prefill_size": int(budget) if chunked else 0,
        "max_running_requests": getattr(scheduler_config, "max_num_seqs", None),
        "max_total_tokens": capacity_tokens(config, engine.scheduler),
        "overlap": getattr(engine, "batch_queue", None) is not None,
        "dp_attention": lockstep is not None,  # a MoE model's engines step in lockstep (DPEngineCoreProc)
        "method": method or "vllm",
        "dispatch": "dpboard" if method else "vllm",
        "dp_size": dp_size,
        "max_num_batched_tokens": budget,
        "async_scheduling": bool(getattr(scheduler_config, "async_scheduling", False)),
        "enable_prefix_caching": bool(getattr(config.cache_config, "enable_prefix_caching", False)),
        "block_size": getattr(config.cache_config, "block_size", None),
        "policy": str(getattr(scheduler_config, "policy", "")) or None,
    }
    header = {"engine_version": vllm_version(), "settings": settings_doc}
    step_log = StepLog(settings.directory, engine="vllm", rank=rank, header=header, max_bytes=settings.max_bytes)
    log.info("dpboard: the engine core of DP rank %d records its steps in %s", rank, step_log.path)
    return step_log
