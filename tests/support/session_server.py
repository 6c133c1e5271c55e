"""A real engine server started as a user starts it, for the serving tests and benchmarks: one
command in a session of its own (so that every process it starts can be found and stopped), its
log in a file, HTTP on a free loopback port. tests/support/vllm_serving.py and sglang_serving.py
say which command, environment and flags; this module is what they share.

Fault injection (``fault_file``): the server's processes get ``tests/support/serving_fault`` on
``PYTHONPATH``, whose ``sitecustomize`` makes dpboard's pick raise while that file exists.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
FAULT_DIR = Path(__file__).resolve().parent / "serving_fault"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TAKEN = "address already in use"
ServerT = TypeVar("ServerT", bound="SessionServer")


def ready_server(make: Callable[[], ServerT], *, attempts: int = 3, **wait: Any) -> ServerT:
    """``make()``'s server once ready (``wait_ready(**wait)``), started again when it quit because its
    port was taken between ``free_port()``'s pick and its bind (any process may take a port the
    kernel has just handed out and let go: SGLang's own internal ports, a client's connection). ``make``
    picks a fresh port each time; at most ``attempts`` starts, and any other failure is raised at once."""
    for attempt in range(1, attempts + 1):
        server = make()
        try:
            server.ready_after = server.wait_ready(**wait)
            return server
        except AssertionError:
            taken = server.proc.poll() is not None and PORT_TAKEN in server.log().lower()
            server.kill()
            if not taken or attempt == attempts:
                raise
            server.log_path.unlink(missing_ok=True)
    raise AssertionError(f"attempts must be at least 1, got {attempts}")


class SessionServer:
    """``command`` run with ``env`` (over this environment less the variables that start with one
    of ``drop_prefixes``), in a session of its own; ``self.port`` is the port it should serve on."""

    name = "server"
    ready_after = 0.0  # seconds from the start until it answered (ready_server sets it)

    def __init__(self, command: list[str], env: dict[str, str], *, port: int, drop_prefixes: tuple[str, ...] = (),
                 fault_file: Path | None = None, fault_target: str = "") -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"{self.name.replace(' ', '-')}-", suffix=".log")[1])
        full = {k: v for k, v in os.environ.items() if not k.startswith(("DPBOARD_", *drop_prefixes))}
        full.update(env)
        if fault_file is not None:
            full["DPBOARD_TEST_FAULT_FILE"] = str(fault_file)
            full["DPBOARD_TEST_FAULT_TARGET"] = fault_target
            full["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULT_DIR), full.get("PYTHONPATH")) if p)
        self.command = command
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full, cwd=ROOT, start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self, timeout: float, path: str = "/health") -> float:
        """Seconds until ``path`` answered 200; an error with the log's tail if the server died first."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
                pass
            time.sleep(1.0)
        raise AssertionError(f"{self.name} not ready after {timeout:g} s:\n{self.tail()}")

    def pids(self) -> list[int]:
        """Every process of the server's session (the command and all it started), alive now."""
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
        """The server's processes whose command line (the engine's process title) starts with ``title``."""
        out = []
        for pid in self.pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmdline.startswith(title):
                out.append(pid)
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 8000) -> str:
        return self.log()[-n:]

    def wait_gone(self, timeout: float) -> float:
        """Seconds until the command and every process of its session are gone (an error after ``timeout``)."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs {timeout:g} s after it was stopped:\n{self.tail()}") from None
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

    def get(self, path: str, timeout: float = 30) -> tuple[int, Any]:
        """(status, JSON answer) of a GET; an error status is returned, not raised."""
        return self._send(urllib.request.Request(f"{self.url}{path}"), timeout)

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
             timeout: float = 120) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of a POST; an error status is returned, not raised."""
        return self._send(urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(), method="POST",
                                                 headers={"Content-Type": "application/json", **(headers or {})}),
                          timeout)

    @staticmethod
    def _send(request: urllib.request.Request, timeout: float) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"error": text}


def pip_error_lines(target: str) -> list[str]:
    """The lines that start with ERROR in what pip said while `make TARGET` built this interpreter's
    environment (the Makefile keeps pip's messages in ``<venv>/pip-messages.log``): a successful build
    that prints "ERROR:" reads as a failure to whoever runs it."""
    log = Path(sys.prefix) / "pip-messages.log"
    assert log.is_file(), f"{log} is missing: the environment was not built by `make {target}`"
    return [line for line in log.read_text().splitlines() if line.lstrip().upper().startswith("ERROR")]
