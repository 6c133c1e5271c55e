"""``DPBOARD_METHOD=inflight_wave`` inside a real SGLang server with DP attention: ``sglang.launch_server
--dp-size 2 --tp-size 2 --enable-dp-attention --load-balance-method total_tokens`` on the CPU (a
server of its own, as test_dp_attention.py starts it), DPBOARD_WAVE_MAX_HOLD=8 and
DPBOARD_WAVE_PER_RANK=2 (a wave of 4 on the two ranks).

The group decodes when each rank streams a long request (routed to it: a routed request is never
held). Then an arrival is held by SGLang's own DP controller loop, timed by nothing but its turns,
and answered once its bound has passed (at least half the hold); four arrivals fill a wave and are answered at once; with
nothing decoding nothing is held. SIGTERM to the main process alone (SGLang's graceful path: the
tokenizer drains what it has sent) while a request is held: it is answered, then the server ends and
leaves nothing of the board. What tells held from not held is time: a held arrival waits at least
half the hold (4 s), an 8-token answer that is not held comes well within that here."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.snapshot import SlotStatus
from tests.integrations.sglang.serving.conftest import serving
from tests.support.procutil import wait_until
from tests.support.sglang_serving import stream_generate

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1200)]
DP = 2
MAX_HOLD = 8.0  # DPBOARD_WAVE_MAX_HOLD: the longest an arrival waits, less a group step
HALF = MAX_HOLD / 2  # the shortest a held arrival waits, whatever step the board reports
PER_RANK = 2  # DPBOARD_WAVE_PER_RANK
ANSWER = 10.0  # seconds an 8-token answer may take past its release on a loaded 2-core machine
# the plugin's default: on this CPU a decoding rank publishes every 15th decode batch, more than 1 s
# apart, and a hold with every rank stale has no rank that decodes (it leaves at once)
STALE_AFTER = 5.0
SETTLE = 120.0
LONG = 4000  # tokens of a streamed request: it decodes until the test closes it
LIVE = int(SlotStatus.LIVE)


@pytest.fixture(scope="module")
def server():
    with serving("inflight_wave", {"DPBOARD_WAVE_MAX_HOLD": str(MAX_HOLD), "DPBOARD_WAVE_PER_RANK": str(PER_RANK)},
                 dp_attention=True) as srv:
        yield srv


def records(server) -> np.ndarray:
    with Board.attach(server.board) as board:
        return board.reader(stale_after=STALE_AFTER).read_array().copy()


def settled(server) -> bool:
    r = records(server)
    return (r["status"] == LIVE).all() and not r["num_running_reqs"].any() and not r["num_waiting_reqs"].any()


@contextmanager
def group_decodes(server):
    """A long stream on each rank, both running on the board; closed (aborted by SGLang) at the end."""
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)
    conns = [stream_generate(server, f"a long story {rank}", LONG, rank) for rank in range(DP)]
    try:
        assert wait_until(lambda: records(server)["num_running_reqs"].tolist() == [1] * DP, timeout=SETTLE), \
            records(server)
        yield
    finally:
        for conn in conns:
            conn.close()


def timed(server, text: str) -> tuple[float, int]:
    """Seconds until SGLang answered an 8-token request, and the rank that served it."""
    began = time.monotonic()
    status, answer = server.generate(text, 8)
    assert status == 200, answer
    assert answer["meta_info"]["completion_tokens"] == 8, answer["meta_info"]
    return time.monotonic() - began, answer["meta_info"]["dp_rank"]


def test_the_controller_says_it_holds_and_how_long(server):
    log = server.log()
    assert re.search(rf"dpboard: DP dispatch by inflight_wave\b.* over board '{re.escape(server.board)}'", log), \
        log[-4000:]
    assert (f"dpboard: arrivals held while the group decodes, {PER_RANK} per rank fill a wave, none longer than "
            f"{MAX_HOLD:g} s less a group step (DPBOARD_WAVE_PER_RANK, DPBOARD_WAVE_MAX_HOLD)") in log


def test_nothing_is_held_while_no_rank_decodes(server):
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)
    took, _ = timed(server, "an idle group")
    assert took < HALF, took  # a held lone arrival waits at least HALF


def test_a_lone_arrival_is_held_while_the_group_decodes_and_answered_after_its_bound(server):
    """Held its bound: the hold less the group step the board reports, and at least half the hold
    (SGLang's gen_throughput, read right after the idle gap before the streams, gives a step of
    seconds here: dpboard.controller.wave). It cannot have been answered sooner."""
    with group_decodes(server):
        took, _ = timed(server, "one alone")
    assert HALF <= took < MAX_HOLD + ANSWER, took


def test_a_full_wave_is_answered_at_once(server):
    """The 4th arrival fills the wave: all four leave before any bound. (Where: inflight_lockstep's
    pick for the batch; four short prompts fit one rank's chunk, one extend step for the group either
    way, so they may all go to one rank.)"""
    with group_decodes(server), ThreadPoolExecutor(DP * PER_RANK) as pool:
        answers = list(pool.map(lambda i: timed(server, f"wave {i}"), range(DP * PER_RANK)))
    assert max(took for took, _ in answers) < HALF, answers


def test_sigterm_to_the_main_process_answers_the_held_request_then_leaves_nothing(server):
    """The last test: SGLang's tokenizer drains at SIGTERM, the held request among what it waits for;
    the DP controller's loop turns on meanwhile and sends it at its bound. The streams are closed
    once it is answered, the drain ends, and so does the server, board and records removed."""
    with group_decodes(server), ThreadPoolExecutor(1) as pool:
        held = pool.submit(timed, server, "held at SIGTERM")
        time.sleep(1.0)  # it has reached the controller
        os.kill(server.proc.pid, signal.SIGTERM)
        took, _ = held.result(timeout=MAX_HOLD + 60)
        assert took >= HALF, took
        assert "SIGTERM received" in server.log(), server.tail()
    server.wait_gone(240)
    assert server.pids() == [], server.tail()
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{server.board}")), timeout=60), \
        (sorted(SHM_DIR.glob(f"dpboard*{server.board}")), server.tail())
