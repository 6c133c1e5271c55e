"""What the flood tests share: silent TCP peers, a child's fd limit, and its CPU, fds and memory read
from /proc."""

from __future__ import annotations

import errno
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable


def limit_fds(limit: int) -> Callable[[], None]:
    """A ``preexec_fn`` that sets the child's RLIMIT_NOFILE, soft and hard, to ``limit``."""

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return lower


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of ``pid`` so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, seconds: float) -> float:
    """CPU-seconds per wall second ``pid`` used over the next ``seconds``."""
    cpu0, wall0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)  # a measuring window, not a wait for an event
    return (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """``pid``'s resident memory now (``VmRSS``) or at its peak (``VmHWM``), in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SilentFlood:
    """Keeps up to ``keep_open`` TCP connections to ``port`` open that never send a byte; each one the
    far end closes is replaced (at most ``reopen_per_second`` beyond the first ``keep_open``), until
    ``total`` have been opened or ``seconds`` are up."""

    def __init__(self, port: int, *, keep_open: int, total: int, seconds: float,
                 reopen_per_second: int = 200) -> None:
        self.port = port
        self.keep_open, self.total, self.seconds = keep_open, total, seconds
        self.reopen_per_second = reopen_per_second
        self.opened = 0
        self.closed_by_peer = 0
        self.holding = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SilentFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        started = time.monotonic()
        deadline = started + self.seconds
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                allowed = self.keep_open + int((time.monotonic() - started) * self.reopen_per_second)
                while len(sel.get_map()) < self.keep_open and self.opened < min(self.total, allowed):
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.setblocking(False)
                    err = s.connect_ex(("127.0.0.1", self.port))
                    if err not in (0, errno.EINPROGRESS):
                        s.close()
                        break
                    sel.register(s, selectors.EVENT_READ)
                    self.opened += 1
                self.holding = len(sel.get_map())
                for key, _ in sel.select(0.05):
                    s = key.fileobj
                    try:
                        data = s.recv(4096)  # the server's greeting, or its close
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        s.close()
                        self.closed_by_peer += 1
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()
            sel.close()
