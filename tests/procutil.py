"""Bounded waits on child processes, shared by the tests that start real processes."""

from __future__ import annotations

import select
import signal
import subprocess
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.01) -> bool:
    """Polls ``predicate`` until it is true or ``timeout`` seconds pass; returns its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def read_line(proc: subprocess.Popen, timeout: float = 15.0) -> str:
    """One line of a child's stdout, or fail after ``timeout`` (never hang on a silent child)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output from {proc.args} within {timeout} s")
    return proc.stdout.readline()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s; always reaps the child."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Like wait_until, but fails the test naming what did not happen."""
    if not wait_until(predicate, timeout, interval=0.02):
        raise AssertionError(f"timed out waiting for {what}")


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL (no clean exit wanted) and reap."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
