"""A real ``sglang.launch_server`` on the CPU, as a user runs it, for the SGLang serving tests and the
serving benchmark (tools/bench_sglang_serving.py): SGLang 0.5.23 unchanged in the environment
`make test-sglang-serving` builds (tools/sglang_cpu_env.py: torch's CPU build, two shims outside
SGLang, the tiny model), ``--dp-size 2``, one core per scheduler, HTTP on a free loopback port.

``Server(dp_attention=True)`` runs ``--enable-dp-attention --tp-size 2`` instead: the DP ranks step in
lockstep, one core each. Two things differ there, both for SGLang's sake, none for dpboard's:

- **the model**: the same tiny model as a Qwen3 (``DP_MODEL``; tools/sglang_cpu_env.py ``model
  --arch qwen3``). SGLang 0.5.23's Llama has no DP attention: ``LlamaAttention`` takes a share of the
  heads by the whole TP size (sglang/srt/models/llama.py:184) while the KV cache is sized for the
  attention TP size, and no layer gathers the ranks' tokens around the MLP; the first request fails
  in the torch-native attention (torch_native_backend.py:172, one head against two), and an idle
  rank's empty batch in the native rotary embedding (rotary_embedding/base.py:347), a path a model
  with DP attention never takes (Qwen3's layer skips attention for an empty batch, qwen3.py:460).
- **a test shim** (tests/support/sglang_dp_attention/sitecustomize.py on the server's
  ``PYTHONPATH``): ``TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value``, which SGLang's CPU
  padding of a DP-attention batch calls (forward_batch_info.py:2014) and only its AMX backend
  defines; the shim gives the torch-native backend the AMX backend's 1.

``Server`` runs it in a session of its own (tests/support/session_server.py), its log in a file;
``wait_ready`` waits for SGLang's ``/health``; ``stop`` sends SIGTERM to the server's process group,
as a service manager stopping it does (SIGTERM to the main process alone drains for up to 5 s
per round before SGLang stops), and waits for every process of the session.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from tests.support.session_server import ROOT, SessionServer, free_port

SGLANG_VENV = ROOT / ".venv-sglang"
MODEL = Path(os.environ.get("DPBOARD_SGLANG_MODEL") or SGLANG_VENV / "model").resolve()
DP_MODEL = Path(os.environ.get("DPBOARD_SGLANG_DP_MODEL") or SGLANG_VENV / "model-qwen3").resolve()
DP_ATTENTION_SHIM = Path(__file__).resolve().parent / "sglang_dp_attention"
START_TIMEOUT = 600.0  # seconds: 30-70 s on an idle 2-core machine, minutes while it is loaded
STOP_TIMEOUT = 120.0
KV_TOKENS = 8192  # per DP rank; without --max-total-tokens SGLang sizes the KV cache from free RAM
# SGLang's CPU engine (SGLANG_USE_CPU_ENGINE), no model hub, one core per scheduler (required once
# dp x tp > 1). SGLang binds each scheduler's OpenMP threads to its cores only on a CPU with AMX or
# on arm64 (sglang/srt/distributed/bootstrap.py, _init_cpu_threads_env); elsewhere torch gives each
# scheduler one OpenMP thread per core of the machine, so two schedulers run four spinning threads
# on two cores, and once both ranks are busy together a step takes 10-20 times as long
# (docs/REPLAY.md). OMP_NUM_THREADS=1: one thread per scheduler, as the binding would give.
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
# The torch-native attention and sampling (no sgl_kernel op is called on a CPU without AMX), no
# CUDA graphs, no warm-up request (the tests send their own).
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--skip-server-warmup", "--max-total-tokens", str(KV_TOKENS),
             "--max-running-requests", "16")
_KV_LINE = re.compile(r" DP(\d+)\] max_total_num_tokens=(\d+),")


def missing(dp_attention: bool = False) -> str | None:
    """Why this interpreter cannot run the SGLang serving tests (None when it can)."""
    for module in ("sglang", "sgl_kernel"):  # sgl_kernel: its CPU shim (tools/sglang_cpu_env.py)
        if importlib.util.find_spec(module) is None:
            return f"no {module} in {sys.executable}: run `make test-sglang-serving` (it builds {SGLANG_VENV})"
    if not (MODEL / "config.json").exists():
        return f"no model in {MODEL}: `make test-sglang-serving` builds it (tools/sglang_cpu_env.py model)"
    if dp_attention and not (DP_MODEL / "config.json").exists():
        return (f"no model in {DP_MODEL}: `make test-sglang-serving` builds it "
                f"(tools/sglang_cpu_env.py model --arch qwen3)")
    return None


class Server(SessionServer):
    """One ``python -m sglang.launch_server --model-path MODEL --dp-size 2`` and its log
    (``dp_attention``: ``--model-path DP_MODEL --dp-size 2 --enable-dp-attention --tp-size 2``)."""

    name = "sglang server"

    def __init__(self, env: dict[str, str], *, dp: int = 2, extra: tuple[str, ...] = (),
                 fault_file: Path | None = None, dp_attention: bool = False) -> None:
        port = free_port()
        model = MODEL
        if dp_attention:
            if fault_file is not None:  # both are a sitecustomize: only the first on the path would run
                raise ValueError("the fault injection and the DP-attention shim cannot share a server")
            model = DP_MODEL
            extra = ("--enable-dp-attention", "--tp-size", str(dp), *extra)
            env = {**env, "PYTHONPATH": os.pathsep.join(
                p for p in (str(DP_ATTENTION_SHIM), env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))) if p)}
        command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--dp-size", str(dp),
                   "--host", "127.0.0.1", "--port", str(port), *CPU_FLAGS, *extra]
        self.seen_pids: set[int] = set()
        super().__init__(command, {**CPU_ENV, **env}, port=port, drop_prefixes=("SGLANG_",), fault_file=fault_file,
                         fault_target="sglang")

    def wait_ready(self, timeout: float = START_TIMEOUT, path: str = "/health") -> float:
        took = super().wait_ready(timeout, path)
        self.seen_pids.update(self.pids())  # every process that may have made a segment is up by now
        return took

    def kill(self) -> None:
        """As ``SessionServer.kill``; then the POSIX shared memory SGLang's processes made and could
        not unlink (SGLang ends its processes with SIGKILL): its pid-stamped ``sgl_shm_<kind>_<pid>_*``
        segments, e.g. the TP group's broadcast queue that ``--tp-size 2`` makes."""
        self.seen_pids.update(self.pids())
        super().kill()
        for path in Path("/dev/shm").glob("sgl_shm_*"):
            parts = path.name.split("_")
            if len(parts) >= 4 and parts[-2].isdigit() and int(parts[-2]) in self.seen_pids:
                path.unlink(missing_ok=True)

    def schedulers(self, dp: int = 2) -> list[list[int]]:
        """The pids of each DP rank's scheduler (SGLang's process title ``sglang::scheduler_DP<k>``)."""
        return [self.titled(f"sglang::scheduler_DP{rank}") for rank in range(dp)]

    def kv_capacity(self) -> dict[int, int]:
        """What SGLang logged per DP rank: ``max_total_num_tokens``."""
        return {int(m[1]): int(m[2]) for m in _KV_LINE.finditer(self.log())}

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> float:
        """``signum`` to the server's process group; seconds until every process of its session is gone."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass
        return self.wait_gone(timeout)

    def generate(self, text: str, max_new_tokens: int, *, routed_dp_rank: int | None = None,
                 timeout: float = 300) -> tuple[int, dict[str, Any]]:
        """SGLang's native ``/generate``, greedy, ``max_new_tokens`` tokens whatever the model says."""
        body: dict[str, Any] = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                                  "ignore_eos": True}}
        if routed_dp_rank is not None:
            body["routed_dp_rank"] = routed_dp_rank
        return self.post("/generate", body, timeout=timeout)

    def completion(self, prompt: str, max_tokens: int, timeout: float = 300) -> tuple[int, dict[str, Any]]:
        return self.post("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0.0, "ignore_eos": True}, timeout=timeout)


def stream_generate(server: Server, text: str, max_new_tokens: int, routed_dp_rank: int) -> http.client.HTTPConnection:
    """A streamed ``/generate`` routed to ``routed_dp_rank``, read in a thread; closing the connection
    makes SGLang abort the request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", "/generate", json.dumps({
        "text": text, "stream": True, "routed_dp_rank": routed_dp_rank,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0},
    }), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()[:2000]
    threading.Thread(target=drain, args=(response,), daemon=True).start()
    return conn


def drain(response) -> None:
    try:
        while response.read(4096):
            pass
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        pass  # closed by the test: SGLang aborts the request


def smg_command() -> Path:
    return Path(sys.executable).with_name("smg")


class Gateway(SessionServer):
    """The SGLang model gateway (``smg launch``, a Rust binary from the ``smg`` wheel) in front of
    ``server``: one worker URL, a policy, its load monitor polling every second; with ``dp_aware`` it
    registers each DP rank as ``URL@rank`` and sends ``routed_dp_rank`` with each request."""

    name = "smg"

    def __init__(self, server: Server, policy: str, *, dp_aware: bool = False) -> None:
        port = free_port()
        command = [str(smg_command()), "launch", "--worker-urls", server.url, "--policy", policy,
                   "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                   "--load-monitor-interval", "1", "--log-level", "debug", *(("--dp-aware",) if dp_aware else ())]
        super().__init__(command, {"NO_COLOR": "1"}, port=port)

    def wait_ready(self, timeout: float = 120, path: str = "/readiness") -> float:
        """Seconds until the gateway has a healthy worker (its /readiness answers 200)."""
        return super().wait_ready(timeout, path)
