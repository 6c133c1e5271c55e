"""``StopFlag``: when a long-running loop must end — SIGTERM, SIGINT or SIGHUP, a duration, or ``set()``.

Every long-running command (``dpboard collect``, ``relay``, ``controller``) loops until one of these
happens, and each exit must be bounded. One flag holds all three::

    with StopFlag(duration=args.duration) as stop:   # installs SIGTERM/SIGINT/SIGHUP handlers (main thread)
        while not stop.is_set():
            work(timeout=stop.remaining(cap=0.1))
    # the previous signal handlers are back here

Outside the main thread no handler can be installed; the flag then ends on its duration or
``set()`` only.

A flag may share its caller's event (``StopFlag(5.0, event=outer.event)``: a bounded inner loop that
still ends on the caller's stop). Its own deadline therefore only ever ends itself: it never sets the
event, which would end the caller's loop too. Signals and ``set()`` do set the event, and end both.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

# SIGHUP too: a closed terminal must clean up as Ctrl-C does, not leave boards and children behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopFlag:
    """A stop request from a signal, a deadline or another thread; a context manager for the signals."""

    def __init__(self, duration: float | None = None, event: threading.Event | None = None) -> None:
        self.event = event or threading.Event()
        self.deadline = None if duration is None else time.monotonic() + duration
        self.signal: int | None = None  # the signal that stopped the loop, if one did
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started under nohup: the hang-up stays ignored, as asked
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signal = signum
        self.event.set()

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        """True once a stop was asked for or the duration has passed. The duration ends this flag
        only: the event (which a caller may share) is left as it is."""
        if self.event.is_set():
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def remaining(self, cap: float | None = None) -> float | None:
        """Seconds until the deadline (None: no deadline), at most ``cap``; 0 once stopped."""
        if self.event.is_set():
            return 0.0
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        if cap is None:
            return left
        return cap if left is None else min(cap, left)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds (less when the deadline comes first); True if stopped."""
        self.event.wait(self.remaining(cap=timeout))
        return self.is_set()
