"""dpboard's improvements (docs/DISPATCH.md, "What dpboard adds"): exact in-flight accounting, health-aware candidates, rotating ties."""

from __future__ import annotations

import random
import struct
import time
from collections import deque

import pytest

from dpboard import Board
from dpboard.controller import Dispatcher, DPBudget, LoadBalanceMethod
from dpboard.methods import ArgminKey
from dpboard.snapshot import FIELDS_OFFSET, SEQ_OFFSET, LoadSnapshot, SlotStatus, slot_offset
from tests.support.dispatch import FakeClock, ListReader, Req, TokReq, make
from tests.support.procutil import wait_until
from tests.support.raw import raw_segment

M = LoadBalanceMethod


class LaggingCluster:
    """Schedulers that receive each request after a delay and publish only every ``publish_every``
    seconds, so a snapshot is several 20 ms windows behind what the controller sent."""

    def __init__(self, n: int, clock: FakeClock, *, delay: float, publish_every: float, seed: int):
        self.n, self.clock, self.delay, self.publish_every = n, clock, delay, publish_every
        self.reader = ListReader(n)
        self.rng = random.Random(seed)
        self.pipes: list[deque] = [deque() for _ in range(n)]  # (arrival time, tokens)
        self.received = [0] * n
        self.load_tokens = [0] * n  # the scheduler's own load: received and not finished
        self.load_reqs = [0] * n
        self.next_publish = clock.now
        # per rank: publish_seq -> (received, requests, tokens) of that snapshot
        self.history: list[dict[int, tuple[int, int, int]]] = [{} for _ in range(n)]

    def send(self, rank: int, tokens: int) -> None:
        self.pipes[rank].append((self.clock.now + self.delay, tokens))

    def advance(self) -> None:
        for r in range(self.n):
            pipe = self.pipes[r]
            while pipe and pipe[0][0] <= self.clock.now:
                _, tokens = pipe.popleft()
                self.received[r] += 1
                self.load_tokens[r] += tokens
                self.load_reqs[r] += 1
            if self.load_reqs[r] and self.rng.random() < 0.3:  # a request finishes
                self.load_reqs[r] -= 1
                self.load_tokens[r] -= self.load_tokens[r] // (self.load_reqs[r] + 1)
        if self.clock.now >= self.next_publish:
            self.next_publish = self.clock.now + self.publish_every
            for r in range(self.n):
                self.reader.set(r, running=self.load_reqs[r], tokens=self.load_tokens[r],
                                received=self.received[r])
                seq = self.reader.snaps[r].publish_seq
                self.history[r][seq] = (self.received[r], self.load_reqs[r], self.load_tokens[r])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_in_flight_accounting_loses_nothing_and_counts_nothing_twice_with_lagging_snapshots(seed):
    clock = FakeClock()
    n = 4
    cluster = LaggingCluster(n, clock, delay=0.045, publish_every=0.07, seed=seed)
    d = Dispatcher(M.TOTAL_TOKENS, n, reader=cluster.reader, clock=clock, inflight_accounting=True)
    sent: list[list[int]] = [[] for _ in range(n)]
    rng = random.Random(seed)
    seen_in_flight = 0
    for i in range(1500):
        clock.now += rng.choice([0.0, 0.0005, 0.002])
        cluster.advance()
        if i % 50 == 49:  # a routed request now and then: counted like the others
            req = TokReq(num_tokens=rng.randint(1, 400), routed_dp_rank=rng.randrange(n))
        else:
            req = TokReq(num_tokens=rng.randint(1, 400))
        rank = d.dispatch(req)
        sent[rank].append(req.num_tokens)
        cluster.send(rank, req.num_tokens)
        # the budget is exactly: the last snapshot the dispatcher took + every request it sent that
        # this snapshot had not received yet
        for r in range(n):
            # the snapshot the dispatcher last took of rank r, as the scheduler published it
            recv, reqs, tokens = cluster.history[r].get(int(d.budget.last_seq[r]), (0, 0, 0))
            in_flight = sent[r][recv:]
            seen_in_flight = max(seen_in_flight, len(in_flight))
            assert d.budget.total_requests[r] == reqs + len(in_flight)
            assert d.budget.total_tokens[r] == tokens + sum(in_flight)
            assert d.budget.in_flight()[r] == len(in_flight)
    assert seen_in_flight >= 10  # the snapshots really did lag by many requests


def test_seed_refresh_erases_in_flight_requests_and_in_flight_accounting_keeps_them():
    results = {}
    for inflight in (False, True):
        clock = FakeClock()
        reader = ListReader(2)
        reader.set(0, tokens=0, received=0)
        reader.set(1, tokens=1000, received=0)
        d = Dispatcher(M.TOTAL_TOKENS, 2, reader=reader, clock=clock, inflight_accounting=inflight)
        first = [d.dispatch(TokReq(num_tokens=400)) for _ in range(3)]
        # rank 0 publishes again before the three requests reach it: its load still says 0
        reader.set(0, tokens=0, received=0)
        clock.now += 0.03
        results[inflight] = (first, d.dispatch(TokReq(num_tokens=400)), d.budget.total_tokens.tolist())
    assert results[False] == ([0, 0, 0], 0, [400, 1000])  # SGLang: the 1200 in-flight tokens vanished
    assert results[True] == ([0, 0, 0], 1, [1200, 1400])


def test_a_restarted_scheduler_or_controller_is_rebased_not_counted_negative():
    clock = FakeClock()
    reader = ListReader(1)
    reader.set(0, tokens=50, received=500)  # counted requests of an earlier controller
    d = Dispatcher(M.INFLIGHT_TOKENS, 1, reader=reader, clock=clock)
    d.dispatch(TokReq(num_tokens=10))
    assert d.budget.total_tokens.tolist() == [60]
    assert d.budget.in_flight().tolist() == [1]
    reader.set(0, tokens=60, received=501)
    clock.now += 1
    d.dispatch(TokReq(num_tokens=10))
    assert d.budget.in_flight().tolist() == [1]
    assert d.budget.total_tokens.tolist() == [70]
    reader.set(0, tokens=0, received=0)  # the scheduler restarted: its counter went back to 0
    clock.now += 1
    d.dispatch(TokReq(num_tokens=5))
    assert d.budget.in_flight().tolist() == [1]
    assert d.budget.total_tokens.tolist() == [5]


def test_more_in_flight_than_the_ledger_holds_is_estimated_from_recent_sizes():
    b = DPBudget(2, inflight_accounting=True, ledger_capacity=4)
    b.set_candidates([True, False])
    for _ in range(10):
        b.dispatch(estimated_tokens=30)
    from dpboard.controller.budget import snapshots_to_array

    b.update_from_array(snapshots_to_array([], 2))
    assert b.in_flight().tolist() == [10, 0]
    assert b.total_tokens.tolist() == [300, 0]


def test_health_aware_never_picks_a_stale_rank(board_name):
    with Board.create(board_name, n_slots=3) as board:
        board.writer(0).publish_values(0, 0, 0, 0, 0, 100, 0)  # the lightest, about to go stale
        time.sleep(0.08)
        for r in (1, 2):
            board.writer(r).publish_values(3, 0, 0, 900, 900, 1000, 0)
        reader = board.reader(stale_after=0.05)
        assert reader.status(0).label == "stale"
        seed = Dispatcher(M.TOTAL_TOKENS, 3, reader=reader)
        improved = Dispatcher(M.INFLIGHT_TOKENS, 3, reader=reader)
        aware = Dispatcher(M.TOTAL_TOKENS, 3, reader=reader, health_aware=True)
        assert seed.dispatch(Req()) == 0
        assert set(improved.dispatch_batch([Req() for _ in range(20)])) == {1, 2}
        assert set(aware.dispatch_batch([Req() for _ in range(20)])) == {1, 2}
        # a fresh publish brings it back
        board.writer(0, takeover=True).publish_values(0, 0, 0, 0, 0, 100, 0)
        improved.refresh()
        assert improved.dispatch(Req()) == 0


def test_health_aware_never_picks_a_torn_rank(board_name):
    with Board.create(board_name, n_slots=2) as board:
        for r in range(2):
            board.writer(r).publish_values(0, 0, 0, 10 * (r + 1), 0, 100, 0)
        # a writer killed between its two sequence stores leaves the sequence odd
        with raw_segment(board.name) as raw:
            struct.pack_into("<Q", raw, slot_offset(0) + SEQ_OFFSET, 7)
        reader = board.reader(max_retries=4)
        assert reader.status(0).label == "torn"
        d = Dispatcher(M.INFLIGHT_TOKENS, 2, reader=reader)
        assert d.dispatch_batch([Req() for _ in range(5)]) == [1] * 5
        with raw_segment(board.name) as raw:
            struct.pack_into("<Q", raw, slot_offset(0) + SEQ_OFFSET, 8)


def test_a_live_writer_caught_mid_write_keeps_its_rank_for_the_torn_grace(board_name):
    """A TORN read of a rank read LIVE just before (its writer descheduled between its two sequence
    stores, as on an oversubscribed host) keeps its last whole snapshot and its place: the lighter
    rank is still picked. Torn for longer than torn_grace after that LIVE read, or torn after a
    STALE read, the rank is left; whole again, it is back."""
    clock = FakeClock()
    with Board.create(board_name, n_slots=2) as board:
        writers = [board.writer(r) for r in range(2)]
        for r, w in enumerate(writers):
            w.publish_values(r * 5, 0, 0, 100 * (r + 1), 0, 1000, 0)  # rank 0 the lighter
        reader = board.reader(max_retries=4, stale_after=60)
        d = Dispatcher(M.INFLIGHT_TOKENS, 2, reader=reader, clock=clock, torn_grace=0.5)
        assert d.dispatch(Req()) == 0

        def seq(value: int) -> None:
            with raw_segment(board.name) as raw:
                struct.pack_into("<Q", raw, slot_offset(0) + SEQ_OFFSET, value)

        seq(7)  # mid-write
        assert reader.status(0).label == "torn"
        clock.now += 0.3
        d.refresh()
        assert d.budget.status.tolist()[0] == int(SlotStatus.TORN) and d.budget.total_tokens.tolist()[0] >= 100
        assert d.dispatch(Req()) == 0  # within the grace: its last whole snapshot stands
        clock.now += 0.3  # 0.6 s after its last LIVE read, still odd: its writer died mid-write
        d.refresh()
        assert d.dispatch_batch([Req() for _ in range(3)]) == [1, 1, 1]
        seq(8)  # a new writer of the slot starts from the odd value plus one: whole again
        writers[0].publish_values(0, 0, 0, 100, 0, 1000, 0)
        clock.now += 0.1
        d.refresh()
        assert d.dispatch(Req()) == 0
        # torn after a STALE read: left at once, whatever the grace. Rank 0's stamp is made old in
        # place (its sequence even: a whole write of long ago), so no wait decides which rank is stale
        stale = Dispatcher(M.INFLIGHT_TOKENS, 2, reader=reader, clock=clock, torn_grace=10.0)
        with raw_segment(board.name) as raw:
            stamp = slot_offset(0) + FIELDS_OFFSET + 8 * LoadSnapshot._fields.index("monotonic_ns")
            struct.pack_into("<q", raw, stamp, 1)
        stale.refresh()
        assert stale.budget.status.tolist() == [int(SlotStatus.STALE), int(SlotStatus.LIVE)]
        seq(11)
        clock.now += 0.01
        stale.refresh()
        assert stale.budget.status.tolist() == [int(SlotStatus.TORN), int(SlotStatus.LIVE)]
        assert stale.dispatch(Req()) == 1
        seq(12)


def test_health_aware_with_only_unhealthy_ranks_raises(board_name):
    with Board.create(board_name, n_slots=2) as board:
        writers = [board.writer(r) for r in range(2)]
        for w in writers:
            w.publish_values(0, 0, 0, 0, 0, 100, 0)
        reader = board.reader(stale_after=0.05)
        assert wait_until(lambda: {reader.status(r).label for r in range(2)} == {"stale"}, timeout=10)
        d = Dispatcher(M.INFLIGHT_REQUESTS, 2, reader=reader)
        with pytest.raises(RuntimeError, match="unavailable or unhealthy"):
            d.dispatch(Req())
        with pytest.raises(RuntimeError, match="unavailable or unhealthy"):
            d.dispatch_batch([Req(), Req()])
        assert d.budget.sent_reqs.tolist() == [0, 0]  # a refused request charged nobody
        assert Dispatcher(M.TOTAL_REQUESTS, 2, reader=reader).dispatch(Req()) == 0  # the seed still picks
        writers[1].publish_values(0, 0, 0, 0, 0, 100, 0)  # rank 1 comes back
        d.refresh()
        assert d.dispatch_batch([Req(), Req()]) == [1, 1]


def test_rotating_ties_spread_equal_loads_after_each_refresh():
    picks = {}
    for rotate in (False, True):
        clock = FakeClock()
        reader = ListReader(4)
        d = Dispatcher(M.TOTAL_TOKENS, 4, reader=reader, clock=clock, rotate_ties=rotate)
        out = []
        for _ in range(6):
            for r in range(4):
                reader.set(r, tokens=100, running=1)  # every rank publishes the same load again
            clock.now += 0.05
            out.append(d.dispatch(Req()))
        picks[rotate] = out
    assert picks[False] == [0] * 6
    assert picks[True] == [0, 1, 2, 3, 0, 1]


def test_improved_methods_switch_every_option_on_and_options_can_be_named_alone():
    reader = ListReader(2)
    d = Dispatcher("inflight_tokens", 2, reader=reader)
    assert (d.inflight_accounting, d.health_aware, d.rotate_ties) == (True, True, True)
    d = Dispatcher("total_tokens", 2, reader=reader)
    assert (d.inflight_accounting, d.health_aware, d.rotate_ties) == (False, False, False)
    d = Dispatcher("inflight_requests", 2, reader=reader, rotate_ties=False)
    assert (d.inflight_accounting, d.health_aware, d.rotate_ties) == (True, True, False)


# -- a send that fails is taken back out of the load ------------------------------------------------


@pytest.mark.parametrize("method", [M.TOTAL_TOKENS, M.INFLIGHT_TOKENS, M.INFLIGHT_REQUESTS])
def test_retracting_failed_sends_leaves_c_and_python_with_only_what_was_delivered(method):
    """Random batches; per batch some ranks refuse their latest picks, which are retracted latest
    first. Both cores must agree at every step, and end where a run that only ever sent the
    delivered requests ends."""
    rng = random.Random(7)
    n = 4
    clock = FakeClock()
    readers = [ListReader(n), ListReader(n)]
    dispatchers = [Dispatcher(method, n, reader=readers[i], clock=clock, use_extension=use)
                   for i, use in enumerate((True, False))]
    delivered_reqs = [0] * n
    delivered_tokens = [0] * n
    for step in range(40):
        clock.now += 0.005
        batch = [TokReq(rng.randrange(0, 500), routed_dp_rank=rng.choice([None, None, None, 1]))
                 for _ in range(rng.randrange(1, 12))]
        picks = [d.dispatch_batch(batch) for d in dispatchers]
        assert picks[0] == picks[1]
        refusing = {r for r in range(n) if rng.random() < 0.3}
        for d in dispatchers:
            for rank, req in reversed(list(zip(picks[0], batch, strict=True))):
                if rank in refusing:
                    d.retract(rank, req)
        for rank, req in zip(picks[0], batch, strict=True):
            if rank not in refusing:
                delivered_reqs[rank] += 1
                delivered_tokens[rank] += req.num_tokens
        a, b = (d.budget for d in dispatchers)
        for field_name in ("total_requests", "total_tokens", "sent_reqs", "sent_tokens"):
            assert getattr(a, field_name).tolist() == getattr(b, field_name).tolist(), (step, field_name)
    budget = dispatchers[0].budget
    assert budget.sent_reqs.tolist() == delivered_reqs
    assert budget.sent_tokens.tolist() == delivered_tokens
    assert budget.total_requests.tolist() == delivered_reqs  # no snapshot was ever published
    assert budget.total_tokens.tolist() == delivered_tokens


@pytest.mark.parametrize("use_extension", [True, False])
def test_in_flight_tokens_after_a_retraction_are_those_of_the_delivered_sends(use_extension):
    d, reader, clock = make(M.INFLIGHT_TOKENS, n=2, use_extension=use_extension)
    d.dispatch(TokReq(100, routed_dp_rank=0))
    d.dispatch(TokReq(30, routed_dp_rank=0))
    failed = TokReq(5000, routed_dp_rank=0)
    d.retract(d.dispatch(failed), failed)
    d.dispatch(TokReq(40, routed_dp_rank=0))  # overwrites the retracted send's ring slot
    reader.set(0, running=1, tokens=100, received=1)  # the first request arrived
    clock.now += 1
    d.refresh()
    assert d.budget.in_flight().tolist() == [2, 0]
    assert d.budget.total_requests.tolist() == [3, 0]
    assert d.budget.total_tokens.tolist() == [100 + 30 + 40, 0]


@pytest.mark.parametrize("use_extension", [True, False])
def test_retracting_what_was_never_charged_is_a_clear_error(use_extension):
    budget = DPBudget(2, use_extension=use_extension)
    with pytest.raises(ValueError, match=r"rank 1 has no such send in its ledger \(0 sends"):
        budget.retract(1, 10)
    budget.charge(1, 10)
    with pytest.raises(ValueError, match="no such send"):
        budget.retract(1, 11)
    with pytest.raises(ValueError, match="0 <= rank < 2"):
        budget.retract(2, 0)
    budget.retract(1, 10)
    assert budget.total_requests.tolist() == [0, 0] and budget.sent_reqs.tolist() == [0, 0]


def test_retract_is_a_no_op_for_methods_without_load():
    d, _, _ = make(M.ROUND_ROBIN, n=3)
    first = d.dispatch(Req())
    d.retract(first, Req())
    assert [d.dispatch(Req()) for _ in range(2)] == [1, 2]


# -- bounds: no budget sum wraps ------------------------------------------------------------------

MAX = 2**63 - 1


@pytest.mark.parametrize("method", [M.TOTAL_TOKENS, M.INFLIGHT_TOKENS, M.INFLIGHT_BACKLOG, M.TOTAL_REQUESTS])
@pytest.mark.parametrize("use_extension", [True, False])
def test_a_request_larger_than_the_bound_is_refused_and_charges_nothing(method, use_extension):
    """num_tokens=2**63-1 used to be accepted and wrap the rank's budget to -2, so that rank kept
    being picked."""
    d, reader, _ = make(method, n=2, use_extension=use_extension)
    for bad in (2**63 - 1, 2**32 + 1):
        with pytest.raises(ValueError, match=r"num_tokens must be an int in \[0, 4294967296\]"):
            d.dispatch(TokReq(num_tokens=bad))
        with pytest.raises(ValueError, match=r"\[0, 4294967296\]"):
            d.dispatch_batch([TokReq(num_tokens=5), TokReq(num_tokens=bad)])
    assert d.budget.total_tokens.tolist() == [0, 0] and d.budget.sent_reqs.tolist() == [0, 0]
    assert d.dispatch(TokReq(num_tokens=2**32)) in (0, 1)  # the bound itself is a request


@pytest.mark.parametrize("method", [M.TOTAL_TOKENS, M.INFLIGHT_TOKENS, M.INFLIGHT_BACKLOG])
def test_budget_sums_saturate_alike_in_c_and_python(method):
    """A rank published at 2**63-1 plus a routed charge used to go negative and win every argmin."""
    results = []
    for use in (True, False):
        d, reader, clock = make(method, n=3, use_extension=use)
        reader.set(0, running=MAX, waiting=MAX, tokens=MAX, used=0, received=0)
        reader.set(1, tokens=10, used=10)
        reader.set(2, tokens=20, used=20)
        picks = [d.dispatch(TokReq(num_tokens=2**32, routed_dp_rank=0)) for _ in range(3)]
        picks += [d.dispatch(TokReq(num_tokens=100)) for _ in range(4)]
        clock.now += 1
        picks += d.dispatch_batch([TokReq(num_tokens=2**32) for _ in range(4)])
        b = d.budget
        assert (b.total_tokens >= 0).all() and (b.total_requests >= 0).all() and (b.backlog >= 0).all()
        assert b.total_tokens[0] == MAX and b.total_requests[0] == MAX
        assert 0 not in picks[3:]  # the saturated rank stays the most loaded
        results.append((picks, b.total_tokens.tolist(), b.total_requests.tolist(), b.backlog.tolist(),
                        b.sent_tokens.tolist()))
    assert results[0] == results[1]


@pytest.mark.parametrize("use_extension", [True, False])
def test_charges_saturate_at_the_top(use_extension):
    budget = DPBudget(2, use_extension=use_extension, inflight_accounting=True)
    budget.total_tokens[0] = MAX - 5
    budget.total_requests[0] = MAX
    budget.sent_tokens[0] = MAX - 1
    budget.charge(0, 2**32)
    assert budget.total_tokens[0] == MAX and budget.total_requests[0] == MAX and budget.sent_tokens[0] == MAX
    with pytest.raises(ValueError, match=r"0 <= tokens <= 4294967296"):
        budget.charge(1, 2**32 + 1)
    with pytest.raises(ValueError, match=r"estimated tokens must be in \[0, 4294967296\]"):
        budget.dispatch(M.TOTAL_TOKENS, 2**40)


@pytest.mark.parametrize("use_extension", [True, False])
def test_inflight_ttft_keeps_the_batch_being_prefilled_in_the_backlog(use_extension):
    def budget(by_headroom: bool) -> DPBudget:
        return DPBudget(2, key=ArgminKey.HEADROOM if by_headroom else ArgminKey.BACKLOG, inflight_accounting=True,
                        use_extension=use_extension)

    def publish(b: DPBudget, seq: int, *, waiting: int, used: int, waiting_tokens: int) -> list[int]:
        """Rank 0 publishes as it starts a step; rank 1 is idle. Returns the backlogs."""
        b.update_budget([
            LoadSnapshot(dp_rank=0, num_waiting_reqs=waiting, num_used_tokens=used,
                         num_total_tokens=used + waiting_tokens, max_total_num_tokens=10_000,
                         num_received_reqs=3, publish_seq=seq, timestamp_ns=seq),
            LoadSnapshot(dp_rank=1, max_total_num_tokens=10_000, publish_seq=seq, timestamp_ns=seq),
        ])
        return b.backlog.tolist()

    ttft, backlog = budget(True), budget(False)
    for b in (ttft, backlog):
        for tokens in (100, 200, 300):
            b.charge(0, tokens)
    # all three received and waiting: the engine's figure holds them all
    assert publish(ttft, 1, waiting=3, used=0, waiting_tokens=600) == [600, 0]
    # a prefill step took the first two (FCFS): the engine reports only the third as queued, while
    # the 300 tokens of the batch are still ahead of a new request's first token
    assert publish(ttft, 2, waiting=1, used=300, waiting_tokens=300) == [600, 0]
    assert publish(backlog, 1, waiting=3, used=0, waiting_tokens=600) == [600, 0]
    assert publish(backlog, 2, waiting=1, used=300, waiting_tokens=300) == [300, 0]
    # a decode step admits nothing: the batch has given its first tokens
    assert publish(ttft, 3, waiting=1, used=302, waiting_tokens=300) == [300, 0]
    # a refresh without a new snapshot changes nothing
    assert publish(ttft, 3, waiting=1, used=302, waiting_tokens=300) == [300, 0]
    # the third request's prefill
    assert publish(ttft, 4, waiting=0, used=602, waiting_tokens=0) == [300, 0]
    # a retraction puts a request back in the queue: nothing counts as newly admitted
    assert publish(ttft, 5, waiting=1, used=302, waiting_tokens=300) == [300, 0]
    assert publish(ttft, 6, waiting=1, used=303, waiting_tokens=300) == [300, 0]
    # new sends add on top, as in-flight tokens, until the rank counts them
    ttft.charge(0, 50)
    assert ttft.backlog.tolist() == [350, 0]
    # after a gap in the reads (no dispatch for a while: snapshots 2 and 3 were never read) the rank
    # admitted the three long ago: they are not the batch of the step it starts now
    late = budget(True)
    for tokens in (100, 200, 300):
        late.charge(0, tokens)
    assert publish(late, 1, waiting=3, used=0, waiting_tokens=600) == [600, 0]
    assert publish(late, 4, waiting=0, used=606, waiting_tokens=0) == [0, 0]
