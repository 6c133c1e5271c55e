"""``inflight_lockstep``: the pick for ranks in lockstep (docs/DISPATCH.md, "inflight_lockstep"),
worked by hand, the C core against its Python twin, and the board's lockstep section it reads.

The budget's figures are set by hand in the first cases: per rank its queued prefill (backlog), its
running requests, its KV tokens and capacity, and its chunk. A prompt of ``u`` uncached tokens has
its first token on rank r in ``s = ceil((backlog + u) / chunk)`` group steps and adds ``s -
ceil(backlog / chunk)`` prefill steps there; the ranks within ``max(earliest s, horizon)`` steps
compete on ``running * added steps`` (the decodes the prefill stalls), then ``s``, then tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dpboard import Board
from dpboard.controller import Dispatcher, DPBudget, LoadBalanceMethod, resolve_load_balance_method
from dpboard.controller.dispatcher import DEFAULT_LOCKSTEP_HORIZON, default_lockstep_chunk
from dpboard.errors import InvalidInputError
from dpboard.methods import ArgminKey
from dpboard.snapshot import LoadDetail, LoadSnapshot, LockstepDetail, pack_detail, unpack_detail
from tests.support.dispatch import TokReq

M = LoadBalanceMethod
BOTH = pytest.mark.parametrize("use_extension", [True, False], ids=["c", "python"])


def budget(use_extension: bool, horizon: int, rows: list[tuple[int, int, int, int]], chunk: int = 512) -> DPBudget:
    """A lockstep budget whose ranks hold ``rows``: (backlog, running, tokens, capacity) each."""
    b = DPBudget(len(rows), key=ArgminKey.LOCKSTEP, lockstep_horizon=horizon, lockstep_chunk=chunk,
                 use_extension=use_extension)
    for r, (backlog, running, tokens, capacity) in enumerate(rows):
        b.backlog[r], b.running[r], b.total_tokens[r], b.capacity[r] = backlog, running, tokens, capacity
    return b


ROWS = [
    (0, 40, 5000, 10_000),  # idle queue, 40 running
    (200, 10, 6000, 10_000),  # prefilling a 200-token tail: its chunk has 312 tokens of room
    (0, 5, 3000, 10_000),
    (1500, 0, 2000, 10_000),  # three chunks queued, nobody running
]


@BOTH
def test_a_prompt_that_fits_the_chunk_under_way_stalls_nobody(use_extension):
    # u = 300: every rank but 3 has its first token in 1 step; rank 1 adds no prefill step (200 + 300
    # fit one chunk) and stalls nobody; rank 3 (4 steps) is beyond max(1, horizon 2)
    assert budget(use_extension, 2, ROWS).core.pick_tokens(300) == 1
    # with a horizon of 4 steps rank 3 (0 running) competes, but rank 1 ties it at 0 and comes sooner
    assert budget(use_extension, 4, ROWS).core.pick_tokens(300) == 1


@BOTH
def test_among_the_ranks_within_the_horizon_the_fewest_stalled_decodes_win(use_extension):
    # u = 400: rank 1 now needs a second step (10 stalled), rank 2 one step (5 stalled), rank 0 one (40)
    assert budget(use_extension, 2, ROWS).core.pick_tokens(400) == 2
    # horizon 4: rank 3 (s = ceil(1900 / 512) = 4, one step added, nobody running) stalls nobody
    assert budget(use_extension, 4, ROWS).core.pick_tokens(400) == 3
    # horizon 0 is the earliest step only: the same ranks as horizon 1 here
    assert budget(use_extension, 0, ROWS).core.pick_tokens(400) == 2


@BOTH
def test_ranks_whose_kv_cannot_hold_the_prompt_come_last(use_extension):
    full = [*ROWS]
    full[2] = (0, 5, 9800, 10_000)  # 9800 + 400 > 10 000
    assert budget(use_extension, 2, full).core.pick_tokens(400) == 1
    # no rank has room: the one with the fewest tokens + u frees room first (inflight_ttft's rule)
    none = [(0, 1, 9900, 10_000), (0, 1, 9700, 10_000), (0, 1, 9800, 10_000)]
    assert budget(use_extension, 2, none).core.pick_tokens(400) == 1


@BOTH
def test_when_every_queue_is_deep_only_the_earliest_first_token_counts(use_extension):
    # first tokens in 11, 13 and 12 steps: beyond the horizon, only the earliest (rank 0) remains,
    # although it runs the most decodes
    rows = [(5000, 90, 1000, 10**6), (6000, 0, 1000, 10**6), (5500, 1, 1000, 10**6)]
    assert budget(use_extension, 6, rows).core.pick_tokens(300) == 0


@BOTH
def test_equal_keys_go_to_the_earlier_first_token_then_fewer_tokens(use_extension):
    rows = [(600, 0, 3000, 10**6), (0, 0, 4000, 10**6), (0, 0, 2000, 10**6)]
    # rank 0: s = ceil(900/512) = 2; ranks 1 and 2: s = 1; all stall nobody: rank 2 (fewer tokens)
    assert budget(use_extension, 6, rows).core.pick_tokens(300) == 2


@BOTH
def test_the_chunk_is_each_ranks_own(use_extension):
    rows = [(0, 10, 1000, 10**6), (0, 10, 1000, 10**6)]
    b = budget(use_extension, 0, rows, chunk=512)
    b.chunk[1] = 2048
    # 1000 tokens: two steps on rank 0 (20 stalled decode-steps), one on rank 1 (10)
    assert b.core.pick_tokens(1000) == 1


@BOTH
def test_a_cached_prefix_is_not_prefilled(use_extension):
    b = budget(use_extension, 2, ROWS)
    # rank 0 holds 900 of the 1000 prompt tokens: 100 to compute, one step, 40 stalled; rank 3 holds
    # them all: s = ceil(1500/512) = 3 (beyond max(1, 2)); rank 2: 1000 tokens, two steps, 10
    savings = np.array([900, 0, 0, 1000], np.int64)
    assert b.core.pick_saving(TokReq(1000), savings) == (2, 1000)
    # charged its uncached part only: rank 0 holding 290 of 300 tokens computes 10, in one step
    b = budget(use_extension, 2, ROWS)
    assert b.core.pick_saving(TokReq(300), np.array([290, 0, 0, 0], np.int64)) == (1, 300)
    # rank 1's chunk now holds 500 of 512 tokens: a second step (10 stalled); rank 0 computes 10
    # tokens in one step (40 stalled), rank 2 300 (5 stalled)
    assert b.core.pick_saving(TokReq(300), np.array([290, 0, 0, 0], np.int64)) == (2, 300)


@BOTH
def test_a_pick_charges_the_rank_as_the_other_inflight_methods_do(use_extension):
    b = budget(use_extension, 2, ROWS)
    assert b.core.pick_tokens(300) == 1
    assert (int(b.backlog[1]), int(b.total_tokens[1]), int(b.total_requests[1])) == (500, 6300, 1)
    # the next 300 tokens no longer fit rank 1's chunk (800 > 512): one step added, 10 stalled; rank 2: 5
    assert b.core.pick_tokens(300) == 2


def test_the_c_core_and_the_python_twin_pick_alike():
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        rows = [(int(rng.integers(0, 4000)) * int(rng.integers(0, 2)), int(rng.integers(0, 60)),
                 int(rng.integers(0, 9000)), int(rng.choice([0, 10_000]))) for _ in range(n)]
        horizon = int(rng.integers(0, 8))
        c, py = budget(True, horizon, rows), budget(False, horizon, rows)
        chunks = rng.integers(0, 1024, n)
        for b in (c, py):
            b.chunk[:] = chunks
            b.candidate[:] = rng.random(n) < 0.9 if trial % 3 == 0 else True
            b.core.next_start = int(trial % n)
        for b in (c, py):  # the same candidate mask in both
            b.candidate[:] = c.candidate
        for _ in range(20):
            u = int(rng.integers(0, 3000))
            savings = rng.integers(0, 3000, n).astype(np.int64)
            if not c.candidate.any():
                with pytest.raises(Exception, match="no DP rank"):
                    c.core.pick_tokens(u)
                with pytest.raises(Exception, match="no DP rank"):
                    py.core.pick_tokens(u)
                break
            if rng.random() < 0.5:
                assert c.core.pick_tokens(u) == py.core.pick_tokens(u)
            else:
                assert c.core.pick_saving(TokReq(u), savings) == py.core.pick_saving(TokReq(u), savings)
            assert np.array_equal(c.backlog, py.backlog) and c.core.next_start == py.core.next_start


@BOTH
def test_the_core_refuses_a_lockstep_pick_without_its_arrays(use_extension):
    from dpboard.controller import budget as budget_module

    core_type = budget_module.ArgminCore if use_extension else budget_module.PyArgminCore
    z8, z1 = np.zeros(2, np.int64), np.ones(2, np.uint8)
    arrays = SimpleNamespace(total_tokens=z8, total_requests=z8.copy(), candidate=z1, routable=z1.copy(),
                             sent_reqs=z8.copy(), sent_tokens=z8.copy(), backlog=z8.copy(), capacity=z8.copy())
    with pytest.raises(ValueError, match="key LOCKSTEP needs the backlog, capacity, running and chunk"):
        core_type(arrays, key=ArgminKey.LOCKSTEP)
    with pytest.raises(ValueError, match="horizon must be >= 0"):
        core_type(arrays, horizon=-1)
    with pytest.raises(InvalidInputError, match="lockstep_chunk must be an int in"):
        DPBudget(2, lockstep_chunk=0, use_extension=use_extension)


def test_auto_picks_the_lockstep_method_for_ranks_in_lockstep():
    assert resolve_load_balance_method("auto", lockstep=True) is M.INFLIGHT_LOCKSTEP
    assert resolve_load_balance_method("auto") is M.ROUND_ROBIN
    # PD keeps its rules: the room on the prefill side, round robin on the decode side
    assert resolve_load_balance_method("auto", "prefill", lockstep=True) is M.FOLLOW_BOOTSTRAP_ROOM
    assert resolve_load_balance_method("auto", "decode", lockstep=True) is M.ROUND_ROBIN
    m = M.INFLIGHT_LOCKSTEP
    assert m.is_improved and m.by_backlog and m.by_headroom and m.uses_prefix_index and m.by_lockstep
    assert not M.INFLIGHT_TTFT.by_lockstep


def test_the_board_carries_each_ranks_lockstep_section(board_name):
    detail = LoadDetail(num_waiting_uncached_tokens=700, lockstep=LockstepDetail(group_size=4, chunk_tokens=2048))
    assert unpack_detail(pack_detail(detail)[0]) == detail
    with Board.create(board_name, n_slots=4) as board:
        for rank in range(3):
            snap = LoadSnapshot(dp_rank=rank, num_running_reqs=10 * rank, max_total_num_tokens=10**6)
            board.writer(rank).publish_detailed(snap, detail if rank == 1 else LoadDetail())
        d = Dispatcher("inflight_lockstep", 4, reader=board.reader())
        assert d.method is M.INFLIGHT_LOCKSTEP and d.lockstep_horizon == DEFAULT_LOCKSTEP_HORIZON
        d.refresh()
        # rank 1 says 2048; the others publish no lockstep section: SGLang's rule for 4 ranks
        assert d.budget.chunk.tolist() == [2048 if r == 1 else default_lockstep_chunk(4) for r in range(4)]
        assert default_lockstep_chunk(4) == 2048 and default_lockstep_chunk(16) == 512
        assert d.budget.running.tolist() == [0, 10, 20, 0]
        assert int(d.budget.backlog[1]) == 700
        # an idle queue, nobody running: rank 0 (first in the scan, fewest tokens)
        assert d.dispatch(TokReq(100)) == 0
        d = Dispatcher("auto", 4, reader=board.reader(), lockstep=True, lockstep_horizon=2, lockstep_chunk=64)
        assert d.method is M.INFLIGHT_LOCKSTEP and d.budget.core.horizon == 2
        d.refresh()
        assert d.budget.chunk.tolist() == [64, 2048, 64, 64]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_on_one_side_of_pd_the_lockstep_pick_is_inflight_ttfts(board_name, mode):
    # a PD server's ranks run no prefill beside their decodes (a prefill server decodes nothing, a
    # decode server prefills nothing): no decode is stalled, and the pick is the smallest queue
    from dpboard.snapshot import DisaggregationDetail

    queued = [3000, 500, 2000, 800]
    running = [0, 40, 2, 9]
    with Board.create(board_name, n_slots=4) as board:
        for rank in range(4):
            detail = LoadDetail(num_waiting_uncached_tokens=queued[rank], disaggregation=DisaggregationDetail(mode),
                                lockstep=LockstepDetail(group_size=4, chunk_tokens=512))
            board.writer(rank).publish_detailed(
                LoadSnapshot(dp_rank=rank, num_running_reqs=running[rank], num_total_tokens=10_000,
                             num_used_tokens=10_000, max_total_num_tokens=10**6), detail)
        picks = {}
        for method in ("inflight_lockstep", "inflight_ttft"):
            d = Dispatcher(method, 4, reader=board.reader())
            picks[method] = [d.dispatch(TokReq(400)) for _ in range(6)]
        assert picks["inflight_lockstep"] == picks["inflight_ttft"]
        assert picks["inflight_ttft"][0] == 1  # the smallest queue, whatever it runs
        # colocated, the same figures pick by stalled decodes: first tokens in 7, 2, 5 and 3 steps of
        # 512 tokens, rank 0 beyond max(2, horizon 6); one step added on each of the others, which
        # stalls 40, 2 and 9 decodes: rank 2
        for rank in range(4):
            board.writer(rank).publish_detailed(
                LoadSnapshot(dp_rank=rank, num_running_reqs=running[rank], num_total_tokens=10_000,
                             num_used_tokens=10_000, max_total_num_tokens=10**6),
                LoadDetail(num_waiting_uncached_tokens=queued[rank], lockstep=LockstepDetail(4, 512)))
        assert Dispatcher("inflight_lockstep", 4, reader=board.reader()).dispatch(TokReq(400)) == 2
