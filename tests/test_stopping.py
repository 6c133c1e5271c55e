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


_SPINNER = """
import sys, threading
from dpboard.stopping import StopFlag
waiter_woke = threading.Event()
for round in range(int(sys.argv[1])):
    with StopFlag() as stop:
        waiter = threading.Thread(target=lambda: stop.event.wait(60) and waiter_woke.set())
        waiter.start()
        print("ready", flush=True)
        while not stop.wait(0.00001):  # in and out of Event.wait, its lock held part of the time
            pass
        waiter.join(60)
        print("stopped", stop.signal, waiter_woke.is_set(), flush=True)
        waiter_woke.clear()
"""


def test_a_signal_during_wait_never_deadlocks_the_flag():
    """A handler that set the event itself ran in the main thread, between two bytecodes of
    ``Event.wait``, sometimes with the event's lock held: it then waited forever for that lock
    (the demo, the collector and the relay hung on SIGTERM in about 5 % of stops of a tight loop).
    Here one process is stopped 150 times in such a loop, each time with a real signal; every stop
    ends it, and another thread waiting on the event wakes too."""
    import subprocess
    import sys

    from tests.support.names import ROOT
    from tests.support.procutil import kill, read_line

    rounds = 150
    proc = subprocess.Popen([sys.executable, "-c", _SPINNER, str(rounds)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for i in range(rounds):
            assert read_line(proc, 60).strip() == "ready", i
            sig = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)[i % 3]
            proc.send_signal(sig)
            assert read_line(proc, 30).strip() == f"stopped {int(sig)} True", f"stop {i} ({sig.name}) did not end the loop"
        assert proc.wait(30) == 0
    finally:
        kill(proc)
