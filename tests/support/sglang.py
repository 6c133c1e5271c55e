"""SGLang's real modules in a process without torch: the import fixture of the SGLang tests.

The tests import each release the plugin supports (``SGLANG_WHEELS``: 0.5.23 in ``.venv/engines``,
0.5.22 in ``.venv/engines-sglang-0.5.22``; the Makefile's ``SGLANG_VERSION`` and ``SGLANG_PREVIOUS``),
the wheel alone (``pip install --no-deps``, which ``make test`` does). A session runs one of them:
``run_session`` puts its folder first on PYTHONPATH and names it in ``DPBOARD_SGLANG_WHEEL``, and
``install()`` refuses any other. SGLang's package ``__init__`` files import torch, transformers and the frontend,
so ``install()`` puts two package *shells* in ``sys.modules`` (``sglang`` and ``sglang.srt.utils``:
modules whose ``__path__`` is the real folder, so their submodules load from the wheel while the
``__init__`` files never run). That is all ``load_snapshot``, ``plugins``, ``hook_registry``,
``environ``, ``runtime_context`` and ``entrypoints.v1_loads`` need: they are imported for real.

``data_parallel_controller`` imports about ten SGLang modules that pull in torch (the scheduler
among them, with the model code). For those, and only those, ``install()`` puts stand-ins
(``STAND_INS`` lists every name and why); a generic stand-in for the third-party packages instead
(torch, triton, transformers, ...) fails in SGLang's own package imports (docs/INTEGRATIONS.md,
"How it is tested"). Where a stand-in must hold SGLang logic, that logic is SGLang's own source, read
from the wheel (``real_defs``), never re-typed: ``TypeBasedDispatcher``, ``is_health_check_generate_req``
and the scheduler's ``publish_load_snapshot`` and batch handlers.

The stand-ins are process-global: the SGLang tests run in a pytest session of their own
(tests/integrations/sglang/test_sglang.py starts one per release; run_dir is tests/integrations/sglang/real).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.support.wheels import wheel_missing

SGLANG_VERSION = "0.5.23"  # the newest release the plugin supports, beside vLLM's wheel in .venv/engines
SGLANG_PREVIOUS = "0.5.22"  # the one before, in a folder of its own (wheel_dir)
SGLANG_WHEELS = (SGLANG_VERSION, SGLANG_PREVIOUS)
WHEEL_VARIABLE = "DPBOARD_SGLANG_WHEEL"  # the release a session runs (run_session sets it)


def wheel_dir(version: str) -> Path:
    """Where the wheel of ``version`` is installed, alone (``.venv/engines`` for the newest)."""
    return Path(sys.prefix) / ("engines" if version == SGLANG_VERSION else f"engines-sglang-{version}")


def how_to_get(version: str) -> str:
    return (f"install SGLang's wheel alone: `.venv/bin/pip install --no-deps --target {wheel_dir(version)} "
            f"sglang=={version}` (`make test` does it)")


HOW_TO_GET = how_to_get(SGLANG_VERSION)


def session_version() -> str:
    """The release this process's session runs: DPBOARD_SGLANG_WHEEL, else the newest."""
    return os.environ.get(WHEEL_VARIABLE) or SGLANG_VERSION


def sglang_missing(version: str | None = None) -> str | None:
    """Why SGLang ``version`` (default: this session's) cannot be imported in this process: the sglang
    found first on the path must be that release (None when it is)."""
    version = version or session_version()
    return wheel_missing("sglang", version, "SGLang", how_to_get(version))


def wheel_absent(version: str) -> str | None:
    """Why a process started with ``wheel_env(version)`` could not import SGLang ``version`` (None
    when it can): the newest must be importable here (tests/conftest.py puts .venv/engines on the
    path), an earlier one must be alone in its folder."""
    if version == SGLANG_VERSION:
        return sglang_missing(version)
    folder = wheel_dir(version)
    found = sorted(d.name for d in folder.glob("sglang-*.dist-info")) if folder.is_dir() else []
    if found != [f"sglang-{version}.dist-info"]:
        return f"SGLang {version}'s wheel is not in {folder}: {how_to_get(version)}"
    return None


def wheel_env(version: str) -> dict[str, str]:
    """The environment of a session on ``version``: its folder first on PYTHONPATH (ahead of
    ``.venv/engines``, which tests/conftest.py puts last) and its name in DPBOARD_SGLANG_WHEEL."""
    env = {WHEEL_VARIABLE: version}
    if version != SGLANG_VERSION:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(wheel_dir(version)), os.environ.get("PYTHONPATH")) if p)
    return env


def wheel_params() -> list[str]:
    """The supported wheels as pytest parameters, the newest first. None is marked ``slow`` (as vLLM's
    earlier one is): a session takes under a minute, so `make test` runs both."""
    return list(SGLANG_WHEELS)


def run_session(version: str, timeout: float = 560) -> None:
    """tests/integrations/sglang/real in a pytest session of its own on the wheel of ``version``
    (tests/support/wheels.py ``run_own_session``: without the wheel skip, in CI fail)."""
    from tests.support.names import ROOT
    from tests.support.wheels import run_own_session

    run_own_session(ROOT / "tests" / "integrations" / "sglang" / "real", "DPBOARD_SGLANG_SESSION",
                    wheel_absent(version), ("DPBOARD_METHOD", "DPBOARD_BOARD", "SGLANG_PLUGINS"),
                    ROOT, wheel_env(version), timeout=timeout)


def sglang_root() -> Path:
    shell = sys.modules.get("sglang")
    if shell is not None and getattr(shell, "__path__", None):
        return Path(shell.__path__[0])
    return Path(importlib.util.find_spec("sglang").origin).parent


def real_defs(relpath: str, names: Iterable[str], namespace: dict[str, Any], *, cls: str | None = None) -> dict:
    """The functions and classes ``names`` (or ``cls``'s methods of those names), compiled from the
    wheel's own source file ``sglang/<relpath>`` into ``namespace``: SGLang's code, not a copy."""
    path = sglang_root() / relpath
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    if cls is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == cls).body
    wanted = set(names)
    picked = [node for node in body
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in wanted]
    missing = wanted - {node.name for node in picked}
    if missing:
        raise LookupError(f"sglang/{relpath} defines no {sorted(missing)}{f' in class {cls}' if cls else ''}")
    for node in picked:
        node.decorator_list = [d for d in node.decorator_list if not _is_stage_decorator(d)]
    module = ast.Module(body=picked, type_ignores=[])
    exec(compile(module, str(path), "exec", flags=_future_flags(tree), dont_inherit=True), namespace)
    return {name: namespace[name] for name in wanted}


def _is_stage_decorator(node: ast.expr) -> bool:
    # scheduler methods carry @scheduler_stage_method(...) (tracing); it does not change what they do
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Name) and target.id == "scheduler_stage_method"


def _future_flags(tree: ast.Module) -> int:
    import __future__

    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    return flags


# -- stand-ins ----------------------------------------------------------------------------------------


class _Plain:
    """A stand-in class: keeps the keyword arguments it is made with as attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def _plain(name: str, module: str = __name__) -> type:
    # __module__ names the stand-in module, so that pickle (SGLang's IPC) finds the class there
    return type(name, (_Plain,), {"__module__": module})


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class TimeStats:
    """Stand-in for DPControllerReqTimeStats (request tracing timestamps; dispatch never reads them)."""

    @classmethod
    def new_from_obj(cls, obj: Any) -> TimeStats:
        return cls()

    def set_dp_dispatch_time(self) -> None:
        pass

    def set_dp_dispatch_finish_time(self) -> None:
        pass


def sock_send(socket: Any, obj: Any, flags: int = 0) -> None:
    """io_struct.sock_send with SGLang's pickle transport (SGLANG_USE_PICKLE_IPC): a real zmq send."""
    socket.send_pyobj(obj, flags=flags)


def sock_recv(socket: Any, flags: int = 0) -> Any:
    return socket.recv_pyobj(flags=flags)


# Every SGLang-internal module replaced by install(dp_controller=True), and why. Each is imported by
# data_parallel_controller.py and pulls in torch (most through the scheduler and its model code);
# the names are those that module imports from it.
STAND_INS: dict[str, str] = {
    "sglang.srt.layers.dp_attention": "compute_dp_attention_world_info (DP-attention launch only)",
    "sglang.srt.managers.io_struct": "request classes (attribute holders; the batch ones lists of requests), "
                                     "sock_send/sock_recv (SGLang's "
                                     "pickle transport on a real zmq socket), wrap_as_pickle/unwrap_from_pickle "
                                     "and PickleWrapper (that transport's: no wrapping)",
    "sglang.srt.managers.schedule_batch": "Req (a type annotation)",
    "sglang.srt.managers.scheduler": "run_scheduler_process (a default argument); Scheduler: SGLang's own "
                                     "publish_load_snapshot and batch handlers, handle_generate_request and "
                                     "handle_embedding_request recording what they get",
    "sglang.srt.managers.utils": "is_health_check_generate_req: SGLang's own function, read from the wheel",
    "sglang.srt.mem_cache.hicache_storage": "merge_l3_layouts (scheduler start-up only)",
    "sglang.srt.observability.req_time_stats": "DPControllerReqTimeStats (tracing timestamps)",
    "sglang.srt.observability.trace": "process_tracing_init, trace_set_thread_info (tracing)",
    "sglang.srt.server_args": "PortArgs (attribute holder; init_new makes a fresh instance_id), ServerArgs, "
                              "DP_ATTENTION_HANDSHAKE_PORT_DELTA",
    "sglang.srt.utils.numa_utils": "module object (scheduler launch only)",
    "sglang.srt.utils.common": "configure_logger, kill_itself_when_parent_died, maybe_reindex_device_id",
    "sglang.srt.utils.torch_memory_saver_adapter": "TorchMemorySaverAdapter (scheduler launch only)",
    "sglang.utils": "TypeBasedDispatcher and get_exception_traceback: SGLang's own, read from the wheel",
}
REQUEST_TYPES = ("ActiveRanksOutput", "BatchTokenizedEmbeddingReqInput", "BatchTokenizedGenerateReqInput",
                 "BlockReqInput", "ElasticScaleUpdateReq", "ProfileReq", "TokenizedEmbeddingReqInput",
                 "TokenizedGenerateReqInput")


class PortArgs(_Plain):
    """Stand-in for server_args.PortArgs: the fields the load-snapshot path reads."""

    instance_id: str = ""
    load_collector_ipc_name: str = ""
    scheduler_input_ipc_name: str = ""

    @staticmethod
    def init_new(server_args: Any, dp_rank: int | None = None, worker_ports: Any = None) -> PortArgs:
        import uuid

        return PortArgs(instance_id=uuid.uuid4().hex[:12])


class Scheduler:
    """Stand-in for managers.scheduler.Scheduler around SGLang's own methods (filled by install())."""

    def __init__(self, load_snapshot_writer: Any = None, load_inquirer: Any = None) -> None:
        self.load_snapshot_writer = load_snapshot_writer
        self.load_inquirer = load_inquirer
        self.taken: list[Any] = []

    def handle_generate_request(self, recv_req: Any, *, mm_input_error: str | None = None) -> None:
        self.taken.append(recv_req)

    def handle_embedding_request(self, recv_req: Any, *, mm_input_error: str | None = None) -> None:
        self.taken.append(recv_req)


def _shell(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__package__ = name
    sys.modules[name] = module
    return module


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def install(dp_controller: bool = True) -> None:
    """The shells (and with ``dp_controller`` the stand-ins); call before any ``import sglang...``."""
    if "sglang" in sys.modules:
        return  # installed already
    reason = sglang_missing()
    if reason:
        raise RuntimeError(reason)
    root = sglang_root()
    _shell("sglang", root)
    utils = _shell("sglang.srt.utils", root / "srt" / "utils")
    utils.get_device_name = lambda device_id=0: None  # what SGLang answers on a machine without accelerator
    if not dp_controller:
        return
    _module("sglang.srt.layers.dp_attention", compute_dp_attention_world_info=_nothing)
    io_name = "sglang.srt.managers.io_struct"
    requests = {name: _plain(name, io_name) for name in REQUEST_TYPES}
    for name in ("BatchTokenizedGenerateReqInput", "BatchTokenizedEmbeddingReqInput"):  # iterate their requests
        requests[name] = type(name, (list,), {"__module__": io_name})
    io_struct = _module(io_name, **requests,
            sock_send=sock_send, sock_recv=sock_recv, unwrap_from_pickle=lambda x: x, wrap_as_pickle=lambda x: x,
            PickleWrapper=_plain("PickleWrapper", io_name))
    _module("sglang.srt.managers.schedule_batch", Req=_plain("Req"))
    import sglang.srt.constants as constants  # real: no imports of its own

    managers_utils = _module("sglang.srt.managers.utils", HEALTH_CHECK_RID_PREFIX=constants.HEALTH_CHECK_RID_PREFIX)
    real_defs("srt/managers/utils.py", ["is_health_check_generate_req"], managers_utils.__dict__)
    namespace = {"logger": logging.getLogger("sglang.srt.managers.scheduler"), "Optional": Any, "List": list,
                 **{name: getattr(io_struct, name) for name in REQUEST_TYPES}}
    for name, fn in real_defs("srt/managers/scheduler.py", ["publish_load_snapshot", "handle_batch_generate_request",
                                                            "handle_batch_embedding_request"],
                              namespace, cls="Scheduler").items():
        setattr(Scheduler, name, fn)
    _module("sglang.srt.managers.scheduler", run_scheduler_process=_nothing, Scheduler=Scheduler)
    _module("sglang.srt.mem_cache.hicache_storage", merge_l3_layouts=_nothing)
    _module("sglang.srt.observability.req_time_stats", DPControllerReqTimeStats=TimeStats)
    _module("sglang.srt.observability.trace", process_tracing_init=_nothing, trace_set_thread_info=_nothing)
    _module("sglang.srt.server_args", DP_ATTENTION_HANDSHAKE_PORT_DELTA=0, PortArgs=PortArgs,
            ServerArgs=_plain("ServerArgs"))
    _module("sglang.srt.utils.numa_utils")
    _module("sglang.srt.utils.common", configure_logger=_nothing, kill_itself_when_parent_died=_nothing,
            maybe_reindex_device_id=_nothing)
    _module("sglang.srt.utils.torch_memory_saver_adapter", TorchMemorySaverAdapter=_Plain)
    sglang_utils = _module("sglang.utils")
    import collections
    import traceback
    import typing

    sglang_utils.__dict__.update({name: getattr(typing, name) for name in typing.__all__})
    sglang_utils.__dict__.update(OrderedDict=collections.OrderedDict, sys=sys, traceback=traceback)
    real_defs("utils.py", ["TypeBasedDispatcher", "get_exception_traceback"], sglang_utils.__dict__)


# -- SGLang's runtime context without a server ----------------------------------------------------------


def set_context(*, dp_size: int = 2, load_balance_method: str = "total_tokens", nnodes: int = 1,
                node_rank: int = 0, attn_dp_enabled: bool = False, tp_size: int = 2, pp_size: int = 1,
                role: str | None = None, tokenizer_worker_num: int = 1, disaggregation_mode: str = "null",
                elastic_ep_backend: Any = None, chunked_prefill_size: int | None = None,
                enable_prefill_delayer: bool | None = None) -> None:
    """Stamp SGLang's runtime context as ``publish(server_args, role=...)`` would leave it for the
    leaves the load path reads (``override*`` would validate names through server_args, a stand-in
    here, so the stamp and the config bags are set directly)."""
    from sglang.srt import runtime_context as rc

    reset_context()
    schedule = {k: v for k, v in {"chunked_prefill_size": chunked_prefill_size,
                                  "enable_prefill_delayer": enable_prefill_delayer}.items() if v is not None}
    rc.get_parallel()._stamp.update(
        attn_dp_enabled=attn_dp_enabled, nnodes=nnodes, node_rank=node_rank, num_dp_ranks=dp_size,
        load_balance_method=load_balance_method, tp_size=tp_size, pp_size=pp_size, max_ep_size=None,
        attn_tp_size=1, attn_cp_size=1, dp_rank=None, enable_dp_attention_local_control_broadcast=False,
    )
    bags = {}
    for namespace, values in {
        "serving": {"tokenizer_worker_num": tokenizer_worker_num},
        "disagg": {"disaggregation_mode": disaggregation_mode},
        "device": {"soft_watchdog_timeout": None},
        "observability": {"enable_metrics": False, "enable_trace": False, "load_snapshot_publish_interval": 15},
        **({"schedule": schedule} if schedule else {}),
    }.items():
        bag = rc._ConfigBag(namespace)
        for key, value in values.items():
            bag._set(key, value)
        bags[namespace] = bag
    exec_bag = rc._ConfigBag("exec")
    moe = rc._ConfigBag("exec.moe")
    moe._set("elastic_ep_backend", elastic_ep_backend)
    exec_bag._set_sub("moe", moe)
    bags["exec"] = exec_bag
    rc.get_context()._config_bags = bags
    rc._CONTEXT._publish_role = role


def reset_context() -> None:
    from sglang.srt import runtime_context as rc

    rc.get_parallel().clear_stamp()
    rc.get_context()._config_bags = None
    rc._CONTEXT._publish_role = None


# -- SGLang snapshots with every field set ------------------------------------------------------------


def full_snapshot(rank: int, k: int = 1, *, timestamp: float | None = None) -> Any:
    """An SGLang ``LoadSnapshot`` with every scalar, ``decode_moments`` and all five sections set, each
    to a value that tells the rank and ``k`` apart (floats with fractions that binary cannot hold)."""
    import sglang.srt.managers.load_snapshot as ls

    f = rank * 100 + k
    return ls.LoadSnapshot(
        timestamp=1_750_000_000.123456 + f if timestamp is None else timestamp,
        dp_rank=rank, num_running_reqs=3 + f, num_waiting_reqs=5 + f, num_waiting_uncached_tokens=70 + f,
        num_used_tokens=1000 + f, num_total_tokens=1500 + f, num_active_tokens=1400 + f,
        num_prealloc_ready_tokens=11 + f, max_total_num_tokens=100_000 + f, max_running_requests=256 + f,
        token_usage=0.1 + f / 1e4, gen_throughput=1234.5 + f, cache_hit_rate=0.3 + f / 1e5, utilization=0.7 + f / 1e6,
        total_prefill_uncached_tokens=10**12 + f, total_prefill_busy_us=10**10 + f,
        decode_moments=[float(f), 2.5 * f, 3.1 * f, 4.2 * f, 5.3 * f, 6.4 * f],
        memory=ls.MemoryMetrics(weight_gb=14.2 + f, kv_cache_gb=60.1 + f, graph_gb=1.3 + f, token_capacity=200_000 + f),
        speculative=ls.SpeculativeMetrics(accept_length=2.7 + f / 100, accept_rate=0.81 + f / 1e4),
        lora=ls.LoRAMetrics(slots_used=2 + f, slots_total=8 + f, utilization=0.25 + f / 1e3),
        disaggregation=ls.DisaggregationMetrics(
            mode=("prefill", "decode", "null")[rank % 3], prefill_bootstrap_queue_reqs=1 + f,
            prefill_inflight_queue_reqs=2 + f, decode_prealloc_queue_reqs=3 + f, decode_transfer_queue_reqs=4 + f,
            decode_retracted_queue_reqs=5 + f, kv_transfer_speed_gb_s=12.5 + f, kv_transfer_latency_ms=0.9 + f),
        queues=ls.QueueMetrics(waiting=5 + f, grammar=1 + f, paused=2 + f, retracted=3 + f, prealloc_ready=4 + f),
    )


def varied_snapshots(dp_size: int, k: int = 1) -> list[Any]:
    """One snapshot per rank, each carrying a different set of sections (rank 0 all of them, rank 1
    none and no decode moments, the others one section each in turn)."""
    import msgspec

    names = ("memory", "speculative", "lora", "disaggregation", "queues")
    out = []
    for rank in range(dp_size):
        snap = full_snapshot(rank, k)
        if rank == 1:
            snap = msgspec.structs.replace(snap, decode_moments=None, **dict.fromkeys(names))
        elif rank >= 2:
            keep = names[(rank - 2) % len(names)]
            snap = msgspec.structs.replace(snap, **{n: None for n in names if n != keep})
        out.append(snap)
    return out
