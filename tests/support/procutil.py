"""Bounded waits on child processes, shared by the tests that start real processes."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
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
    """The next line of a child's stdout, or an AssertionError after ``timeout`` seconds or at EOF.

    The read runs in a thread: select() on the pipe would miss a line already in the text buffer."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no output from {proc.args} within {timeout} s") from None
    if not line:
        raise AssertionError(f"{proc.args} exited ({proc.poll()}) before printing a line")
    return line


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """``sig`` (SIGTERM: a clean exit), then SIGKILL after 30 s (a loaded machine's clean exit can
    take seconds); always reaps the child."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
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


class Waited(BaseException):
    """Raised by ``NoWait.sleep``: the code under test waited for something it will never remove
    (BaseException: the exit paths it runs in catch the others)."""


class NoWait:
    """A ``time`` module for code whose waiting is the error under test: its clock runs, its sleep raises."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def sleep(seconds: float) -> None:
        raise Waited(seconds)
