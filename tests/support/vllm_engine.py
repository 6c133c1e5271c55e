"""A vLLM engine core without a model: vLLM 0.33.0's own ``EngineCoreProc`` request intake and engine
step (``EngineCore.step``), over vLLM's own ``Scheduler`` and ``KVCacheManager``.

Import after ``tests.support.vllm.install()``. ``EngineCoreProc.__init__`` loads a model on a GPU
(executor, KV-cache profiling, the handshake with the API server), so ``make_engine`` builds the
object without it and sets the attributes the intake (``_handle_client_request``, ``add_request``)
and the step loop (``_process_engine_step``, ``step``, ``post_step``) read. Those methods are vLLM's.

The scheduler is vLLM's ``Scheduler`` on the CPU, built as ``EngineCore.__init__`` builds it, from a
real ``VllmConfig`` and a real ``KVCacheConfig`` (dpboard/bench/vllm_engine.py, which ``dpboard bench
vllm`` uses too, and which names its stand-ins: ``ModelConfig``, ``ModelExecutor`` for the model,
the attention specs' ``state_content_bytes``): its chunked prefill, preemption and prefix caching are
vLLM's.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

from vllm.config import CacheConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.request import Request

from dpboard.bench.vllm_engine import (  # noqa: F401  (the tests' names for them)
    TOKEN,
    ModelConfig,
    ModelExecutor,
    block_hasher,
    engine_config,
    kv_cache_config,
    make_scheduler,
    step,
)

ADD = EngineCoreRequestType.ADD


@dataclass
class Config:
    """Stand-in for VllmConfig on the API server's side (the client and the stat logger read these
    four), holding vLLM's own ParallelConfig, CacheConfig and SchedulerConfig."""

    parallel_config: Any
    cache_config: Any
    scheduler_config: Any
    model_config: ModelConfig


def vllm_config(dp: int, rank: int = 0, *, api_servers: int = 1, served_model_name: str | None = "m",
                max_num_seqs: int = 64, block_size: int = 16, num_gpu_blocks: int | None = None,
                kv_cache_size_tokens: int | None = None) -> Config:
    """A deployment's config as an API server holds it (the cache sizes as the API server has them
    after the engines' handshake, core_client.py:873-889)."""
    parallel = ParallelConfig(data_parallel_size=dp, data_parallel_rank=rank)
    parallel._api_process_count = api_servers
    cache = CacheConfig(block_size=block_size)
    cache.num_gpu_blocks = num_gpu_blocks
    cache.kv_cache_size_tokens = kv_cache_size_tokens
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=4096, is_encoder_decoder=False)
    return Config(parallel, cache, scheduler, ModelConfig(served_model_name))


@dataclass
class EngineParts:
    config: Any
    outputs: queue.Queue = field(default_factory=queue.Queue)


def make_engine(config: VllmConfig, scheduler: Scheduler, *, step_seconds: float = 0.0) -> EngineCoreProc:
    """An EngineCoreProc of vLLM's class, not started: its intake and vLLM's own step run on
    ``scheduler``, with ``ModelExecutor`` for the model."""
    engine = object.__new__(EngineCoreProc)
    engine.vllm_config = config
    engine.scheduler = scheduler
    engine.model_executor = ModelExecutor(scheduler, step_seconds)
    engine.structured_output_manager = scheduler.structured_output_manager
    engine.request_block_hasher = block_hasher(config)
    engine.log_stats = True
    engine._weight_version = None
    engine.shutdown_state = EngineShutdownState.RUNNING
    engine.reject_new_requests = False
    engine.output_queue = queue.Queue()
    engine.step_fn = engine.step
    engine.check_for_draft_tokens = False
    engine.async_scheduling = False
    # what run_busy_loop reads (core.py:1172-1290 sets them)
    engine.input_queue = queue.Queue()
    engine.aborts_queue = queue.Queue()
    engine.process_input_queue_block = True
    engine._idle_state_callbacks = []
    engine.engines_running = False
    engine.batch_queue = None
    engine.publish_dp_lb_stats = False
    engine.enable_fault_tolerance = False
    return engine


def real_engine(dp: int = 1, rank: int = 0, *, num_blocks: int = 65, step_seconds: float = 0.0,
                **config: Any) -> EngineCoreProc:
    """``make_engine`` over vLLM's scheduler on a full-attention KV cache of ``num_blocks`` blocks, as
    an engine of a one-node DP deployment (internal load balancing when ``dp`` > 1)."""
    vllm = engine_config(dp, rank, **config)
    scheduler = make_scheduler(vllm, kv_cache_config(num_blocks, vllm.cache_config.block_size),
                               include_finished_set=dp > 1)
    return make_engine(vllm, scheduler, step_seconds=step_seconds)


def engine_request(request_id: str, prompt_len: int, max_tokens: int = 4, *, data_parallel_rank: int | None = None,
                   resumable: bool = False, client_index: int = 0, first_token: int = 1, priority: int = 0,
                   arrival_time: float = 0.0) -> EngineCoreRequest:
    """An EngineCoreRequest as an API server sends it; its prompt ``first_token, first_token + 1, ...``
    (prompts with the same first token share their prefix)."""
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=list(range(first_token, first_token + prompt_len)), mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None, arrival_time=arrival_time,
        priority=priority,
        lora_request=None, cache_salt=None, data_parallel_rank=data_parallel_rank, resumable=resumable,
        client_index=client_index,
    )


def picked_ranks(client: Any, request_ids: list[str], prompt_len: int = 16) -> list[int]:
    """The DP rank of the engine ``client`` picks (``get_core_engine_for_request``) for a request of
    each id, in order."""
    return [int.from_bytes(client.get_core_engine_for_request(engine_request(rid, prompt_len)), "little")
            for rid in request_ids]


def as_request(engine: EngineCoreProc, request: EngineCoreRequest) -> Request:
    """The engine's Request, its block hashes by the engine's hasher (core.py's preprocess_add_request)."""
    return Request.from_engine_core_request(request, engine.request_block_hasher)


def take_in(engine: EngineCoreProc, request: EngineCoreRequest) -> None:
    """What the engine core's input thread then its busy loop do with an ADD (core.py:2000-2012, 1751-1760)."""
    engine._handle_client_request(ADD, (as_request(engine, request), 0))


# -- the API server's side -------------------------------------------------------------------------


def make_client(config: Any, n_engines: int, *, client_index: int = 0, client_count: int = 1,
                first_rank: int = 0) -> Any:
    """A DPLBAsyncMPClient of vLLM's class, not connected (dpboard.bench.dispatch.unconnected_client)."""
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    from dpboard.bench.dispatch import unconnected_client

    return unconnected_client(DPLBAsyncMPClient, config, n_engines, client_index=client_index,
                              client_count=client_count, first_rank=first_rank)


class OutputsDecoder:
    """Stand-in for vLLM's ``MsgpackDecoder(EngineCoreOutputs)``, which cannot be built without torch
    (msgspec refuses the stand-in ``torch.Tensor`` field types): the frames vLLM's ``MsgpackEncoder``
    wrote, decoded by msgspec without a type, fields named by vLLM's own ``__struct_fields__``; it
    keeps what the engine core above sends (index, timestamp, finished ids, each output's id, tokens
    and finish reason). ``strict=False``: vLLM's structs omit trailing default fields."""

    def decode(self, frames: Any) -> EngineCoreOutputs:
        import msgspec

        first = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
        doc = dict(zip(EngineCoreOutputs.__struct_fields__, msgspec.msgpack.decode(first), strict=False))
        outputs = []
        for raw in doc["outputs"] or ():
            out = dict(zip(EngineCoreOutput.__struct_fields__, raw, strict=False))
            reason = out["finish_reason"]
            outputs.append(EngineCoreOutput(request_id=out["request_id"], new_token_ids=out["new_token_ids"],
                                            finish_reason=None if reason is None else FinishReason(reason)))
        finished = doc["finished_requests"]
        return EngineCoreOutputs(engine_index=doc["engine_index"], outputs=outputs, timestamp=doc["timestamp"],
                                 finished_requests=None if finished is None else set(finished))


# -- an API server's client over running engine-core processes --------------------------------------


def engine_manager(processes: list, shutdown_timeout: float | None = None) -> Any:
    """vLLM's ``CoreEngineProcManager`` over engine-core processes already started (its ``__init__``
    builds each one's launch arguments from a full ``VllmConfig``): the attributes it sets
    (vllm/v1/engine/utils.py:247-300 in 0.33.0); its liveness monitor and shutdown are vLLM's."""
    import threading
    import weakref

    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.utils import shutdown

    manager = object.__new__(CoreEngineProcManager)
    manager._request_shutdown_timeout = shutdown_timeout
    manager.processes = processes
    manager._finalizer = weakref.finalize(manager, shutdown, processes)
    manager.manager_stopped = threading.Event()
    manager.failed_proc_name = None
    manager._coord_store = None
    return manager


def connect_client(client: Any, ctx: Any, manager: Any, input_socket: Any, output_socket: Any) -> None:
    """What ``MPClient.__init__`` and ``DPAsyncMPClient.__init__`` set once the engines are up
    (vllm/v1/engine/core_client.py:640-790, 1469-1520 in 0.33.0): vLLM's ``BackgroundResources``
    holding the engine manager and the sockets, its finalizer, the encoder, the outputs queue; then
    vLLM's ``start_engine_core_monitor``. The decoder is ``OutputsDecoder`` (see there). No DP
    coordinator runs: it feeds only vLLM's own ``lb_engines`` counts, which a pick through the board
    does not read, so its stats address has no publisher."""
    import asyncio
    import weakref

    import zmq
    from vllm.utils.network_utils import get_open_zmq_inproc_path, get_open_zmq_ipc_path, make_zmq_socket
    from vllm.v1.engine.core_client import BackgroundResources
    from vllm.v1.serial_utils import MsgpackEncoder

    client.ctx = ctx
    client.resources = BackgroundResources(ctx=ctx, engine_manager=manager, input_socket=input_socket,
                                           output_socket=output_socket)
    client._finalizer = weakref.finalize(client, client.resources)
    client.input_socket = input_socket
    client.encoder = MsgpackEncoder()
    client.decoder = OutputsDecoder()
    client.utility_results = {}
    client.outputs_queue = asyncio.Queue()
    client.current_wave = 0
    client.engines_running = False
    client.engine_ranks_managed = list(range(len(client.core_engines)))
    client.stats_update_address = get_open_zmq_ipc_path()
    # the PAIR socket that wakes vLLM's stats task: "first_req" in vLLM 0.32, "scale" in 0.33
    kind = "first_req" if hasattr(BackgroundResources, "first_req_send_socket") else "scale"
    address = get_open_zmq_inproc_path()
    setattr(client, f"{kind}_sock_addr", address)
    sock = make_zmq_socket(ctx, address, zmq.PAIR, bind=True)
    setattr(client, f"{kind}_send_socket", sock)
    setattr(client.resources, f"{kind}_send_socket", sock)
    client.start_engine_core_monitor()


class _Renderer:
    """Stand-in for vLLM's renderer (it holds the model's tokenizer and multimodal processors): the
    output handler reads its multimodal cache, which a text-only server has none of."""

    mm_processor_cache = None

    def stat_mm_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def make_async_llm(client: Any, config: Any) -> Any:
    """vLLM's ``AsyncLLM`` around ``client``, built without ``__init__`` (which builds the renderer
    and the input processor from the model): the attributes its output handler and ``_add_request``
    read, with vLLM's own ``OutputProcessor`` (no tokenizer: outputs are token ids)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    llm = object.__new__(AsyncLLM)
    llm.vllm_config = config
    llm.scheduler_config = config.scheduler_config
    llm.engine_core = client
    llm.output_processor = OutputProcessor(None, log_stats=False)
    llm.admission_stats = None
    llm.log_stats = False
    llm.log_requests = False
    llm.logger_manager = None
    llm.renderer = _Renderer()
    llm.output_handler = None
    return llm
