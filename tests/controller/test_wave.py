"""``inflight_wave``'s hold (dpboard/controller/wave.py) on hand-worked boards: what is held, when a
wave leaves and why, its bound from the board's step, and that nothing stays held."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from dpboard.controller import Dispatcher, LoadBalanceMethod
from dpboard.controller.wave import WaveHold
from dpboard.errors import InvalidInputError
from dpboard.methods import METHODS, Delivery
from dpboard.sim.policy import SimBoard
from dpboard.snapshot import LoadSnapshot
from tests.support.dispatch import FakeClock, ListReader, TokReq

N = 4


def decoding(reader: ListReader, running: int = 8, waiting: tuple[int, ...] = (0,) * N) -> None:
    """Every rank decodes ``running`` requests; ``waiting[r]`` prompts of 100 tokens queued on rank r."""
    for r in range(N):
        reader.set(r, running=running, waiting=waiting[r], used=running * 1000,
                   tokens=running * 1000 + 100 * waiting[r])


def wave(reader: ListReader | None = None, **options) -> tuple[Dispatcher, ListReader, FakeClock]:
    reader = reader or ListReader(N)
    clock = FakeClock()
    options.setdefault("wave_max_hold", 1.0)
    options.setdefault("wave_per_rank", 1)
    options.setdefault("refresh_interval", 0.02)
    d = Dispatcher("inflight_wave", N, reader=reader, clock=clock, lockstep_chunk=512,
                   **options)
    return d, reader, clock


def test_the_row_holds_and_places_as_the_lockstep_method():
    spec = METHODS[LoadBalanceMethod.INFLIGHT_WAVE]
    assert spec.delivery is Delivery.WAVE and spec.holds and spec.key is METHODS[LoadBalanceMethod.INFLIGHT_LOCKSTEP].key
    assert spec.uses_prefix_index and spec.is_improved
    assert not any(s.holds for m, s in METHODS.items() if m is not LoadBalanceMethod.INFLIGHT_WAVE)


def test_arrivals_while_every_rank_decodes_wait_for_a_full_wave():
    d, reader, clock = wave()
    decoding(reader)
    reqs = [TokReq(100) for _ in range(N)]
    for i, req in enumerate(reqs[:-1]):
        assert d.offer([req]) == []
        assert d.held == i + 1
        clock.now += 0.1
    out = d.offer([reqs[-1]])  # the fourth: one prompt per rank, a full wave
    assert out == reqs and d.held == 0
    assert d.wave.released["full"] == N and d.wave.waves == 1
    assert d.wave.hold_max == pytest.approx(0.3)
    # placed together as inflight_lockstep places a batch: 4 prompts of 100 tokens fill one rank's
    # 512-token chunk, so one rank's decodes stall for one step instead of four ranks' for four
    lockstep_reader = ListReader(N)
    decoding(lockstep_reader)
    lockstep = Dispatcher("inflight_lockstep", N, reader=lockstep_reader, clock=FakeClock(), lockstep_chunk=512)
    assert d.dispatch_batch(out) == lockstep.dispatch_batch(reqs) == [0] * N


def test_an_idle_group_or_a_rank_about_to_prefill_holds_nothing():
    d, reader, clock = wave()
    for r in range(N):
        reader.set(r)  # nothing runs anywhere: no decode to protect
    req = TokReq(100)
    assert d.offer([req]) == [req] and d.wave.held_total == 0
    # rank 3 has nothing at all and no rank is about to prefill: the prompt goes at once (the
    # idle rank takes it; the rule's idle clause)
    decoding(reader)
    reader.set(3)
    clock.now += 0.05
    req = TokReq(100)
    assert d.offer([req]) == [req] and d.wave.held_total == 0


def test_an_idle_rank_beside_queued_prefill_still_holds_and_without_the_idle_rule_too():
    d, reader, clock = wave()
    decoding(reader)
    reader.set(3)  # idle, and rank 2 about to prefill: the group is about to prefill, so hold
    reader.set(2, running=8, waiting=1, used=8000, tokens=8100)
    assert d.offer([TokReq(100)]) == [] and d.held == 1
    d2, reader2, _ = wave(wave_idle=False)
    decoding(reader2)
    reader2.set(3)  # an idle rank alone: held all the same when the idle rule is off
    assert d2.offer([TokReq(100)]) == [] and d2.held == 1


def test_a_wave_leaves_when_the_group_starts_prefilling():
    d, reader, clock = wave()
    decoding(reader)
    held = [TokReq(100), TokReq(200)]
    assert d.offer(held[:1]) == [] and d.offer(held[1:]) == []
    assert d.due() == []
    clock.now += 0.05
    for r in range(N):
        reader.set(r)  # every decode finished: nothing left to stall
    assert d.due() == held and d.wave.released["busy"] == 2


def test_the_oldest_leaves_at_its_bound_and_next_due_at_says_when():
    d, reader, clock = wave(wave_max_hold=0.5)
    decoding(reader)
    start = clock.now
    assert d.offer([TokReq(100)]) == []
    # the next look: the board's next refresh (20 ms) comes before the bound
    assert d.next_due_at() == pytest.approx(start + 0.02)
    clock.now += 0.3
    assert d.offer([TokReq(100)]) == []
    clock.now = start + 0.49
    assert d.due() == []
    clock.now = start + 0.5
    out = d.due()
    assert len(out) == 2 and d.wave.released["bound"] == 2
    assert d.wave.hold_max == pytest.approx(0.5) and d.wave.hold_sum == pytest.approx(0.7)
    assert d.next_due_at() is None


@pytest.mark.parametrize(("slowest", "others", "max_hold", "step", "bound"), [
    # gen_throughput 200 tok/s over 40 running requests: a decode step of 0.2 s on that rank, the
    # group's slowest; a hold of 0.5 s leaves 0.3 s
    (200.0, 800.0, 0.5, 0.2, 0.3),
    # SGLang's gen_throughput after an idle gap (its last 40 decode steps' tokens over the time since
    # its previous decode log, the gap included): 4 tok/s reads a step of 10 s, and the oldest is
    # still held half of the hold, not released at once
    (4.0, 4.0, 2.0, 10.0, 1.0),
])
def test_the_bound_is_the_hold_less_the_group_step_the_board_reports_at_most_half(slowest, others, max_hold,
                                                                                 step, bound):
    clock = FakeClock()
    board = SimBoard(N, clock)
    for r in range(N):
        snap = LoadSnapshot(dp_rank=r, num_running_reqs=40, num_used_tokens=4000, num_total_tokens=4000,
                            max_total_num_tokens=100_000, publish_seq=1, timestamp_ns=1)
        board.publish(r, snap, clock.now, queued_prefill=0, gen_throughput=slowest if r == 1 else others)
    d = Dispatcher("inflight_wave", N, reader=board, clock=clock, wave_max_hold=max_hold, wave_per_rank=4)
    start = clock.now
    assert d.offer([TokReq(100)]) == []
    assert d.wave.step == pytest.approx(step) and d.wave.bound() == pytest.approx(bound)
    clock.now = start + bound - 0.01
    assert d.due() == []
    clock.now = start + bound
    assert len(d.due()) == 1 and d.wave.released["bound"] == 1


def test_routed_requests_are_never_held_and_release_all_leaves_nothing():
    d, reader, _ = wave(wave_per_rank=8)
    decoding(reader)
    free, routed = TokReq(100), TokReq(100, routed_dp_rank=2)
    assert d.offer([free, routed]) == [routed]
    assert d.held == 1
    assert d.release_all() == [free] and d.held == 0 and d.wave.released["shutdown"] == 1
    assert d.release_all() == []


def test_after_a_wave_the_next_arrival_waits_for_the_next_one():
    # the wave's prompts are queued prefill at their ranks (in-flight accounting) and the others
    # still decode: the next arrival is held, not sent after them into the steps they stall
    d, reader, clock = wave()
    decoding(reader)
    out = []
    for _ in range(N):
        out += d.offer([TokReq(300)])
    assert len(out) == N
    d.dispatch_batch(out)
    assert d.offer([TokReq(100)]) == [] and d.held == 1


def test_a_method_that_holds_nothing_returns_what_it_is_given():
    reader = ListReader(N)
    decoding(reader)
    d = Dispatcher("inflight_lockstep", N, reader=reader, clock=FakeClock())
    reqs = [TokReq(1), TokReq(2)]
    assert not d.holds and d.offer(reqs) == reqs
    assert d.due() == [] and d.next_due_at() is None and d.release_all() == [] and d.held == 0


def test_next_due_at_moves_forward_when_the_board_refreshes_at_every_read():
    d, reader, clock = wave(refresh_interval=0.0)
    decoding(reader)
    d.offer([TokReq(100)])
    assert d.next_due_at() > clock.now  # a look at once, for ever, would never let time pass


@dataclass
class FrameReq:
    """A request with the frame it came in, as the ZMQ controller's ``Request`` has."""

    num_tokens: int
    raw: bytes
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


def test_a_wave_leaves_once_its_frames_reach_the_byte_bound_even_within_one_offer():
    d, reader, clock = wave(wave_per_rank=100, wave_max_bytes=1000)
    decoding(reader)
    assert d.offer([FrameReq(100, b"x" * 400), FrameReq(100, b"x" * 400)]) == []
    assert d.wave.held_bytes == 800
    out = d.offer([FrameReq(100, b"x" * 300)])  # 1,100 bytes: the bound reached, far from a full wave
    assert len(out) == 3 and d.held == 0 and d.wave.held_bytes == 0
    assert d.wave.released["bytes"] == 3
    # a batch of arrivals larger than the bound leaves as it fills it: never more held than the bound
    # and the frame that reaches it
    batch = [FrameReq(100, b"x" * 600) for _ in range(5)]
    out = d.offer(batch)
    assert out == batch[:4] and d.held == 1 and d.wave.held_bytes == 600
    assert d.wave.held_bytes_max == 1200 and d.wave.released["bytes"] == 7
    d.bound_held_bytes(None)  # by count alone again
    assert d.offer([FrameReq(100, b"x" * 10**6)]) == [] and d.held == 2


@pytest.mark.parametrize("options, message", [
    ({"wave_max_hold": -1}, "wave_max_hold must be seconds in"),
    ({"wave_max_hold": True}, "wave_max_hold must be seconds in"),
    ({"wave_per_rank": 0}, "wave_per_rank must be an int >= 1"),
    ({"wave_max_bytes": 0}, "max_bytes must be an int >= 1"),
])
def test_bad_options_name_themselves(options, message):
    with pytest.raises(InvalidInputError, match=message):
        wave(**options)


def test_the_step_reads_only_ranks_that_report_one():
    w = WaveHold(1.0)
    w.read_step(np.array([10, 0, 5]), np.array([0.0, 100.0, 50.0]), np.array([1, 1, 0], np.uint8))
    assert w.step == 0.0  # rank 0 reports no throughput, rank 1 runs nothing, rank 2 is no candidate
    w.read_step(np.array([10, 0, 5]), np.array([20.0, 100.0, 50.0]), np.array([1, 1, 1], np.uint8))
    assert w.step == pytest.approx(0.5)


def test_counts_say_what_the_hold_did_as_the_dispatch_record_carries_it():
    hold = WaveHold(max_hold=2.0, wave_per_rank=2)
    for i, now in enumerate((10.0, 10.5, 11.0)):
        hold.hold(f"r{i}", now, nbytes=100)
    assert hold.take(11.5, "full") == ["r0", "r1", "r2"]
    hold.hold("r3", 12.0, nbytes=50)
    counts = hold.counts()
    assert (counts.held, counts.holding, counts.waves, counts.held_bytes, counts.held_bytes_max) == (4, 1, 1, 50, 300)
    assert counts.hold_max_s == 1.5 and counts.hold_sum_s == 1.5 + 1.0 + 0.5 and counts.max_hold_s == 2.0
    assert counts.released_by("full") == 3 and sum(counts.released) == 3
    # a Dispatcher's counts after those of one it replaced (auto changed): totals summed, maxima kept
    later = WaveHold(max_hold=1.0).counts().after(counts)
    assert (later.held, later.holding, later.waves, later.hold_max_s, later.max_hold_s) == (4, 0, 1, 1.5, 1.0)
