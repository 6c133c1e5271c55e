"""``StopFlag``: when a long-running loop must end — SIGTERM, SIGINT or SIGHUP, a duration, or ``set()``.

Every long-running command (``dpboard collect``, ``relay``, ``controller``) loops until one of these
happens, and each exit must be bounded. One flag holds all three::

    with StopFlag(duration=args.duration) as stop:   # installs SIGTERM/SIGINT/SIGHUP handlers (main thread)
        while not stop.is_set():
            work(timeout=stop.remaining(cap=0.1))
    # the previous signal handlers are back here

Outside the main thread no handler can be installed; the flag then ends on its duration or
``set()`` only.

The handler takes no lock. Python runs it in the main thread between two bytecodes, which may be
inside ``Event.wait`` with the event's own lock held: ``Event.set`` there would wait forever for a
lock its own thread holds. The handler only notes the signal and writes a byte to a pipe; a relay
thread reads it and sets the event, so threads waiting on the event wake as they would from
``set()``.

A flag may share its caller's event (``StopFlag(5.0, event=outer.event)``: a bounded inner loop that
still ends on the caller's stop). Its own deadline therefore only ever ends itself: it never sets the
event, which would end the caller's loop too. Signals and ``set()`` do set the event, and end both.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

# SIGHUP too: a closed terminal must clean up as Ctrl-C does, not leave boards and children behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_QUIT = b"\0"  # no signal's number


class SignalRelay:
    """Signal handlers that set events without taking a lock (the module docstring says why): each
    handler calls ``noted(signum)`` (plain attribute writes only) and writes the signal's number to
    a pipe; a relay thread reads it and sets that signal's event. A context manager, from the main
    thread: the previous handlers are back on exit."""

    def __init__(self, events: dict[int, threading.Event], *, noted: Callable[[int], None] | None = None) -> None:
        self.events = dict(events)
        self.noted = noted
        self._previous: dict[int, Any] = {}
        self._read, self._write = -1, -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalRelay:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a handler never blocks on a full pipe
        self._thread = threading.Thread(target=self._run, args=(self._read,), name="dpboard-signals", daemon=True)
        self._thread.start()
        for sig in self.events:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._thread is not None:
            try:
                os.set_blocking(self._write, True)
                os.write(self._write, _QUIT)
            finally:
                self._thread.join(5.0)
                os.close(self._write)
                self._thread = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.noted is not None:
            self.noted(signum)
        try:
            os.write(self._write, bytes((signum,)))
        except OSError:
            pass  # 64 KiB of signals not yet read: the relay is behind, not gone

    def _run(self, fd: int) -> None:
        try:
            while True:
                got = os.read(fd, 64)
                for signum in set(got):
                    if signum in self.events:
                        self.events[signum].set()
                if not got or _QUIT in got:
                    return
        finally:
            os.close(fd)


class StopFlag:
    """A stop request from a signal, a deadline or another thread; a context manager for the signals."""

    def __init__(self, duration: float | None = None, event: threading.Event | None = None) -> None:
        self.event = event or threading.Event()
        self.deadline = None if duration is None else time.monotonic() + duration
        self.signal: int | None = None  # the signal that stopped the loop, if one did
        self._relay: SignalRelay | None = None

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            signals = [sig for sig in STOP_SIGNALS
                       # started under nohup: the hang-up stays ignored, as asked
                       if not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN)]
            self._relay = SignalRelay({sig: self.event for sig in signals}, noted=self._note).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._relay is not None:
            self._relay.__exit__()
            self._relay = None

    def _note(self, signum: int) -> None:
        self.signal = signum

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        """True once a stop was asked for or the duration has passed. The duration ends this flag
        only: the event (which a caller may share) is left as it is."""
        if self.signal is not None or self.event.is_set():
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def remaining(self, cap: float | None = None) -> float | None:
        """Seconds until the deadline (None: no deadline), at most ``cap``; 0 once stopped."""
        if self.signal is not None or self.event.is_set():
            return 0.0
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        if cap is None:
            return left
        return cap if left is None else min(cap, left)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds (less when the deadline comes first); True if stopped."""
        self.event.wait(self.remaining(cap=timeout))
        return self.is_set()
