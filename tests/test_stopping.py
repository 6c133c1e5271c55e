"""StopFlag: a bounded inner loop that shares its caller's event never ends the caller's loop."""

from __future__ import annotations

import os
import signal
import threading
import time

from dpboard.stopping import StopFlag


def test_an_inner_deadline_never_sets_the_shared_event():
    outer = StopFlag()
    inner = StopFlag(0.05, event=outer.event)
    assert not inner.is_set()
    time.sleep(0.1)
    assert inner.is_set() and inner.remaining(cap=1.0) == 0.0
    assert not outer.is_set() and not outer.event.is_set()
    assert inner.wait(0.0)  # wait() reports the expired inner flag as stopped
    assert outer.remaining(cap=1.0) == 1.0  # the caller goes on


def test_a_stop_of_the_caller_ends_the_inner_flag_too():
    outer = StopFlag()
    inner = StopFlag(60.0, event=outer.event)
    threading.Timer(0.05, outer.set).start()
    assert inner.wait(10.0)  # woken by the shared event, long before its own deadline
    assert inner.remaining(cap=1.0) == 0.0


def test_a_signal_sets_the_shared_event():
    with StopFlag() as outer:
        inner = StopFlag(60.0, event=outer.event)
        os.kill(os.getpid(), signal.SIGTERM)
        assert inner.wait(5.0) and outer.is_set() and outer.signal == signal.SIGTERM
