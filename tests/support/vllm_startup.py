"""A vLLM data-parallel deployment started by vLLM's own start-up code, with no GPU and no model.

``python -m tests.support.vllm_startup SPEC_JSON`` is one API server. It builds a real ``VllmConfig``
(vLLM's ``ModelConfig`` reading a model directory's ``config.json``, ``ParallelConfig`` with
``data_parallel_size`` N, ``CacheConfig``, ``SchedulerConfig``), loads the general plugins with
vLLM's loader (dpboard's among them, from ``VLLM_PLUGINS``), and asks vLLM for its client as
``AsyncLLM`` does (``EngineCoreClient.make_async_mp_client``: a ``DPLBAsyncMPClient`` under internal
load balancing). That client's own ``__init__`` runs vLLM's start-up: ``launch_core_engines`` starts
the DP coordinator and, through ``CoreEngineProcManager``, N engine-core processes, each running
``EngineCoreProc.run_engine_core`` (a dense model: ``EngineCoreProc`` after
``reconfigure_for_independent_dp_rank``; a MoE model: ``DPEngineCoreProc``), whose ``__init__``
does vLLM's handshake with this process (``wait_for_engine_startup``) and runs ``EngineCore.__init__``:
the executor, KV-cache sizing (``get_kv_cache_configs``), vLLM's real ``Scheduler`` with its
``KVCacheManager``, then the busy loop.

It prints one JSON line on stdout (vLLM's logs go to stderr), ``{"ready": ...}`` (the client's class,
its engines' DP ranks, the engine-core processes' pids) or ``{"error": ...}``, then answers one JSON
command a line:

- ``{"op": "pick", "n": K}``: K requests through the client's ``get_core_engine_for_request`` (with
  ``DPBOARD_METHOD``, dpboard's pick over the board); answers the DP ranks picked.
- ``{"op": "send", "n": K, "tokens": T, "max_tokens": M}``: K requests of T prompt tokens sent to the
  engines (``generate``); answers the rank each went to and the tokens each got back, once all finished.

At EOF on stdin, or at SIGTERM or SIGINT, it shuts the client down (vLLM stops its engine cores, with
SIGTERM) and exits 0.

SPEC_JSON: ``{"moe": bool, "dp": N, "parallel": {ParallelConfig fields}, "headless": bool}`` (``parallel``
optional: see ``vllm_config``; ``headless``: ``vllm serve --headless``, engine cores and no API server,
``headless()``).

The stand-ins, each where vLLM needs a GPU, a model or torch (docs/INTEGRATIONS.md lists them):

- torch: tests/support/vllm.py's stand-in package, with four names given a real answer here
  (``install``): ``torch.Tensor`` and ``torch.nn.Module`` are classes (msgspec builds vLLM's
  ``MsgpackDecoder(EngineCoreRequest)`` from its field types; vLLM's model registry checks
  ``issubclass(model, nn.Module)``); ``torch.float16`` is a dtype of 2 bytes and ``torch.tensor``
  answers ``element_size()`` for it (vLLM's ``get_dtype_size``, which sizes a KV-cache page).
- the model: ``StandInForCausalLM``, registered with vLLM's ``ModelRegistry.register_model`` (the
  API for out-of-tree models), named by the ``config.json``'s ``architectures``; vLLM inspects it
  in-process (its interfaces), never runs it.
- the executor: ``StandInExecutor``, a subclass of vLLM's ``Executor`` answering the workers' RPCs
  that ``EngineCore.__init__`` makes (one full-attention KV spec per layer, the memory for
  ``NUM_BLOCKS`` blocks, the layouts), and each batch vLLM's scheduler schedules with the model's
  output: token ``TOKEN`` for every request whose prompt is computed (``execute_model``).
- the device: ``DeviceConfig(device="cpu")``, since there is no GPU platform to detect.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tests.support import vllm as sv

BLOCK_SIZE = 16
NUM_BLOCKS = 257  # as the KV cache the stand-in executor reports memory for
NUM_LAYERS = 2
HEAD_SIZE = 64
NUM_KV_HEADS = 1
DTYPE_BYTES = 2
ARCHITECTURE = "StandInForCausalLM"
STORE_WAIT = 60.0
TOKEN = 7  # what the stand-in model samples


def install() -> None:
    """tests/support/vllm.py's stand-ins, and the four torch names that need a real answer here."""
    sv.install()
    import torch
    import torch.nn

    inert = type(torch._dpboard_probe)  # the stand-in package's inert object, for any name it is asked

    class _Type(type):
        def __getattr__(cls, key: str) -> Any:
            if key.startswith("__"):
                raise AttributeError(key)
            return inert(f"{cls.__name__}.{key}")

    class DType:
        def __init__(self, name: str, itemsize: int) -> None:
            self.name, self.itemsize = name, itemsize

        def __repr__(self) -> str:
            return f"torch.{self.name} (stand-in)"

    class Sized:
        def __init__(self, itemsize: int) -> None:
            self._itemsize = itemsize

        def element_size(self) -> int:
            return self._itemsize

    def tensor(*args: Any, dtype: Any = None, **kwargs: Any) -> Any:
        return Sized(dtype.itemsize) if isinstance(dtype, DType) else inert("torch.tensor()")

    if not isinstance(torch.__dict__.get("Tensor"), type):
        import torch.distributed
        import torch.distributed.rendezvous

        torch.distributed.TCPStore = TCPStore
        torch.distributed.rendezvous.rendezvous = rendezvous
        import torch.distributed.distributed_c10d

        torch.distributed.distributed_c10d.Backend = str  # torch's Backend is a str; vLLM compares it to "gloo"
        torch.distributed.DistNetworkError = type("DistNetworkError", (RuntimeError,), {})  # vLLM catches it
        torch.Tensor = _Type("Tensor", (), {})
        torch.nn.Module = type("Module", (), {})  # no attribute of its own: vLLM probes models' interfaces
        torch.dtype = DType  # vLLM's config hash asks isinstance(x, torch.dtype)
        torch.float16 = DType("float16", DTYPE_BYTES)
        torch.tensor = tensor


class TCPStore:
    """Stand-in for ``torch.distributed.TCPStore`` (C++ in torch): a key-value server on a real TCP port
    in the process that makes it with ``is_master``, and a client of it elsewhere; ``set`` and ``get``
    (which waits for the key, up to ``STORE_WAIT`` seconds) are what vLLM's DP start-up calls (the
    coordination store of ``launch_core_engines``, ``_pick_stateless_dp_port``)."""

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 master_listen_fd: int | None = None, **kwargs: Any) -> None:
        self.host = host_name
        self.port = port
        self._file: Any = None
        self._lock = threading.Lock()
        if is_master:
            server = (socket.socket(fileno=master_listen_fd) if master_listen_fd is not None
                      else socket.create_server((host_name, port)))
            self.port = server.getsockname()[1]
            self._data: dict[str, str] = {}
            self._changed = threading.Condition()
            threading.Thread(target=self._serve, args=(server,), name="standin-tcpstore", daemon=True).start()

    def _serve(self, server: socket.socket) -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rw") as f:
            for line in f:
                op, key, value = json.loads(line)
                with self._changed:
                    if op == "set":
                        self._data[key] = value
                        self._changed.notify_all()
                    else:
                        self._changed.wait_for(lambda key=key: key in self._data, timeout=STORE_WAIT)
                        value = self._data.get(key)
                f.write(json.dumps(value) + "\n")
                f.flush()

    def _call(self, op: str, key: str, value: str | None = None) -> str | None:
        with self._lock:
            if self._file is None:
                self._file = socket.create_connection((self.host, self.port), timeout=STORE_WAIT + 5).makefile("rw")
            self._file.write(json.dumps([op, key, value]) + "\n")
            self._file.flush()
            return json.loads(self._file.readline())

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.decode("latin-1") if isinstance(value, bytes) else value)

    def get(self, key: str) -> bytes:
        value = self._call("get", key)
        if value is None:
            raise TimeoutError(f"stand-in TCPStore: no {key!r} after {STORE_WAIT} s")
        return value.encode("latin-1")

    def set_timeout(self, timeout: Any) -> None:
        return None


def rendezvous(url: str, rank: int, world_size: int, **kwargs: Any) -> Any:
    """Stand-in for ``torch.distributed.rendezvous.rendezvous`` (``tcp://host:port``): a client of the
    rank-0 store, as torch's yields one."""
    address = url.removeprefix("tcp://").split("?")[0]
    host, _, port = address.rpartition(":")
    yield TCPStore(host.strip("[]"), int(port)), rank, world_size


def model_dir(moe: bool) -> Path:
    """A model directory holding only a ``config.json`` (a Llama shape, or a Mixtral one with experts)."""
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "mixtral" if moe else "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
    if moe:
        config.update(num_local_experts=4, num_experts_per_tok=2)
    path = Path(tempfile.mkdtemp(prefix="dpboard-vllm-model-"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def register_model() -> None:
    import torch
    from vllm import ModelRegistry

    class StandInForCausalLM(torch.nn.Module):
        """The model vLLM's registry inspects; nothing runs it (StandInExecutor has no workers)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def forward(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the stand-in model is never run")

        compute_logits = embed_input_ids = forward

    StandInForCausalLM.__name__ = StandInForCausalLM.__qualname__ = ARCHITECTURE
    ModelRegistry.register_model(ARCHITECTURE, StandInForCausalLM)


def make_executor_class() -> type:
    import torch
    from vllm.v1.executor import Executor
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    class StandInExecutor(Executor):
        """vLLM's Executor with no workers: the answers its workers would give EngineCore.__init__."""

        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            self.spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                          dtype=torch.float16)
            self.prompt_tokens: dict[str, int] = {}
            self.pending: collections.deque = collections.deque()  # executed batches not yet sampled

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            """The model's answer to one scheduled batch: token ``TOKEN`` for each request whose prompt
            is then computed (a chunk of a longer prompt samples nothing), as a model runner reports it."""
            from concurrent.futures import Future

            from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

            computed = {}
            for new in scheduler_output.scheduled_new_reqs:
                self.prompt_tokens[new.req_id] = len(new.prompt_token_ids or ())
                computed[new.req_id] = new.num_computed_tokens
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            scheduled = scheduler_output.num_scheduled_tokens
            req_ids = list(scheduled)
            sampled = [[TOKEN] if computed[r] + scheduled[r] >= self.prompt_tokens[r] else [] for r in req_ids]
            for finished in scheduler_output.finished_req_ids:
                self.prompt_tokens.pop(finished, None)
            # as a GPU model runner: an empty batch answers an empty output at once; otherwise the
            # forward pass answers None and sample_tokens the batch's output
            answer = None
            if scheduler_output.total_num_scheduled_tokens == 0:
                answer = EMPTY_MODEL_RUNNER_OUTPUT
            else:
                self.pending.append(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                                      req_id_to_index={r: i for i, r in enumerate(req_ids)}))
            if not non_block:
                return answer
            future: Future = Future()
            future.set_result(answer)
            return future

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            from concurrent.futures import Future

            output = self.pending.popleft()
            if not non_block:
                return output
            future: Future = Future()
            future.set_result(output)
            return future

        def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None,
                           non_block: bool = False) -> Any:
            name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
            page = self.spec.page_size_bytes
            answers = {
                "get_kv_cache_spec": lambda: {f"model.layers.{i}.self_attn.attn": self.spec for i in range(NUM_LAYERS)},
                "determine_available_memory": lambda: NUM_BLOCKS * page * NUM_LAYERS,
                "get_supported_kv_cache_layouts": lambda: ["NHD"],
                "set_kv_cache_layout": lambda: None,
                "initialize_from_config": lambda: None,
                "update_max_model_len": lambda: None,
            }
            if name == "compile_or_warm_up_model":
                return []
            if name not in answers:
                raise NotImplementedError(f"StandInExecutor has no worker to answer {name!r}")
            return [answers[name]()]

        def check_health(self) -> None:
            return None

        def shutdown(self) -> None:
            return None

    return StandInExecutor


def vllm_config(model: Path, dp: int, parallel: dict[str, Any] | None = None) -> Any:
    """The config ``vllm serve MODEL --data-parallel-size DP`` builds: on one node with internal load
    balancing by default; ``parallel`` sets more of ParallelConfig's fields, as vLLM's ``--data-parallel-*``
    options do (``data_parallel_size_local``, ``data_parallel_rank`` for ``--data-parallel-start-rank``,
    ``data_parallel_hybrid_lb``, ``data_parallel_master_ip``, ``data_parallel_rpc_port``)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=2048, dtype="float16",
                        served_model_name="stand-in")
    return VllmConfig(model_config=model, parallel_config=ParallelConfig(**{"data_parallel_size": dp, "data_parallel_size_local": dp, **(parallel or {})}),
                      cache_config=CacheConfig(block_size=BLOCK_SIZE), device_config=DeviceConfig(device="cpu"),
                      scheduler_config=SchedulerConfig(max_num_seqs=64, max_model_len=2048, is_encoder_decoder=False))


_PROTOCOL: Any = None  # this process's stdout, kept for the JSON lines; vLLM's logs go to stderr


def say(doc: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(doc) + "\n")
    _PROTOCOL.flush()


async def serve(spec: dict[str, Any]) -> int:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as `vllm serve` does while it parses its arguments
    register_model()
    from vllm.v1.engine.core_client import EngineCoreClient

    from tests.support.vllm_engine import picked_ranks

    model = model_dir(bool(spec["moe"]))
    try:
        config = vllm_config(model, int(spec["dp"]), spec.get("parallel"))
    finally:
        shutil.rmtree(model)  # read: ModelConfig holds the model's config from here on
    if spec.get("headless"):
        return headless(config)
    client = EngineCoreClient.make_async_mp_client(config, make_executor_class(), log_stats=False)
    try:
        say({"ready": True, "pid": os.getpid(), "client": type(client).__name__,
             "engines": [int.from_bytes(e, "little") for e in client.core_engines],
             "engine_pids": [p.pid for p in client.resources.engine_manager.processes]})
        lines = command_lines()
        sent = 0
        while (line := await lines.get()) is not None:
            command = json.loads(line)
            if command["op"] == "pick":
                say({"ranks": picked_ranks(client, [f"p{sent + i}" for i in range(command["n"])])})
                sent += command["n"]
            elif command["op"] == "send":
                say(await generate(client, command["n"], command["tokens"], command["max_tokens"], sent))
                sent += command["n"]
    finally:
        client.shutdown()
    return 0


def command_lines() -> asyncio.Queue:
    """The commands on stdin, a line each, then None: at EOF, or at SIGTERM or SIGINT, which end the
    API server as they end ``vllm serve``'s (its shutdown: ``client.shutdown()``, which stops the engine
    cores with SIGTERM). A daemon thread reads stdin, so a signal never waits for a line."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lines.put_nowait, None)
    threading.Thread(target=read, daemon=True).start()
    return lines


async def generate(client: Any, n: int, tokens: int, max_tokens: int, first: int) -> dict[str, Any]:
    """N requests sent as ``AsyncLLM`` sends them (``add_request_async``: the pick, then an ``ADD`` on
    the engine's input socket), and their outputs read until every one has finished."""
    from vllm.v1.engine.input_processor import InputProcessor

    from tests.support.vllm_engine import engine_request

    ranks = {}
    for i in range(first, first + n):
        request = engine_request(f"g{i}", tokens, max_tokens)
        InputProcessor.assign_request_id(request)  # vLLM's internal id, as the input processor sets it
        await client.add_request_async(request)
        ranks[request.request_id] = int.from_bytes(client.reqs_in_flight[request.request_id], "little")
    tokens_out: dict[str, list[int]] = {rid: [] for rid in ranks}
    finished: set[str] = set()
    while len(finished) < n:
        outputs = await asyncio.wait_for(client.get_output_async(), timeout=60)
        for out in outputs.outputs:
            tokens_out[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished.add(out.request_id)
    return {"ranks": [ranks[r] for r in ranks], "tokens": [tokens_out[r] for r in ranks]}


def headless(config: Any) -> int:
    """``vllm serve --headless`` on a node of its own (entrypoints/cli/serve.py ``run_headless``): its
    engine cores started by vLLM's ``CoreEngineProcManager`` as remote engines (``local_client=False``) of
    the front-end at ``data_parallel_master_ip:data_parallel_rpc_port``; no API server."""
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager

    parallel = config.parallel_config
    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local, start_index=parallel.data_parallel_rank,
        local_start_index=0, vllm_config=config, local_client=False,
        handshake_address=get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port),
        executor_class=make_executor_class(), log_stats=False)
    try:
        say({"ready": True, "pid": os.getpid(), "client": None,
             "engines": list(range(parallel.data_parallel_rank, parallel.data_parallel_rank + len(manager.processes))),
             "engine_pids": [p.pid for p in manager.processes]})
        sys.stdin.read()  # until EOF (run_headless waits on the engines' liveness instead)
    finally:
        manager.shutdown()
    return 0


def main() -> int:
    global _PROTOCOL
    # vLLM logs to stdout, in this process and in the engine cores it starts (which inherit fd 1)
    _PROTOCOL = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    install()
    try:
        return asyncio.run(serve(json.loads(sys.argv[1])))
    except Exception as e:
        say({"error": type(e).__name__, "message": str(e)})
        raise


if __name__ == "__main__":
    sys.exit(main())
