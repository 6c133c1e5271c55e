"""Each of ``dpboard doctor``'s rules alone, on samples made by hand (tests/support/views.py): where
it fires, with its evidence word for word, and where it stays silent. The whole doctor on real
boards, controllers and processes is tests/views/test_doctor.py."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dpboard.errors import InvalidInputError
from dpboard.methods import METHODS
from dpboard.views import doctor
from dpboard.views.doctor import (
    RULES,
    Finding,
    Window,
    check_dispatch_vs_load,
    check_dp_size,
    check_fallbacks,
    check_idle,
    check_inflight_stuck,
    check_kv_saturation,
    check_load_unaware_skew,
    check_pd_rendezvous,
    check_prefill_round_robin,
    check_record,
    check_refresh_rate,
    check_rejected,
    check_rooms_uneven,
    check_routed_one_rank,
    check_stale_or_torn,
    diagnose,
)
from tests.support.views import WRITER_PID, dispatch_row, pd_queues, rank_row, sample

BOARD = "doctor-rules"


def live(n: int, **fields: object) -> list[dict]:
    return [rank_row(k, **fields) for k in range(n)]


def window(*samples: doctor.Sample, stale_after: float = 1.0) -> Window:
    return Window.of(list(samples), stale_after)


def dispatched(start: list, end: list, *, ranks: list[dict] | None = None, dt: float = 1.0) -> Window:
    """Two reads ``dt`` seconds apart of a board of live ranks whose dispatch record holds the rows
    ``start``, then ``end`` (same rows, counts grown)."""
    ranks = ranks or live(len(end[0].per_rank))
    return window(sample(0.0, ranks, dispatch=start), sample(dt, ranks, dispatch=end))


def one(found: list[Finding], id: str) -> Finding:
    assert [f.id for f in found] == [id], found
    return found[0]


# -- the table ---------------------------------------------------------------------------------------


def test_every_rule_of_the_module_is_in_the_table_once():
    rules = [f for name, f in inspect.getmembers(doctor, inspect.isfunction) if name.startswith("check_")]
    assert len(RULES) == len(set(RULES)) == 15
    assert set(RULES) == set(rules)


def test_diagnose_lists_the_most_serious_first_then_in_the_tables_order():
    """A warning from an early rule (stale_or_torn), a critical from a later one (pd_rendezvous), an
    info from the record rule between them."""
    decode = [rank_row(0, pd=pd_queues("decode", transfer=1)), rank_row(1, pd=pd_queues("decode", transfer=1)),
              rank_row(2, "stale", age_s=3.0)]
    grown = [rank_row(0, pd=pd_queues("decode", transfer=4)), *decode[1:]]
    found = diagnose([sample(0.0, decode), sample(1.0, grown)])
    assert [f.id for f in found] == ["pd_rendezvous", "stale_or_torn", "no_record"]


def test_the_rules_read_the_methods_from_the_method_table():
    """Doctor (which may not import the controller) takes the methods' names and traits from the leaf
    table: no method name is a literal of its own, and what reads no load is what the rows say."""
    names = {m.value for m in METHODS}
    tree = ast.parse(Path(doctor.__file__).read_text())
    literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    assert not literals & names
    assert doctor.LOAD_UNAWARE == tuple(m.value for m, spec in METHODS.items() if not spec.is_load_aware)
    # a name the table does not know (another dpboard's method) is judged by none of its traits
    rows = [dispatch_row(2, method="round_robin_v2", mode="prefill")]
    assert check_prefill_round_robin(window(sample(0.0, live(2), dispatch=rows))) == []


def test_diagnose_needs_a_sample():
    with pytest.raises(InvalidInputError, match="at least one sample"):
        diagnose([])


# -- dp_size and the live ranks ----------------------------------------------------------------------


def test_dp_size_one_slot():
    f = one(check_dp_size(window(sample(0.0, live(1)))), "one_slot")
    assert (f.severity, f.title, f.evidence) == ("warning", "one slot: dp_size is 1", f"board {BOARD!r} has 1 slot")


def test_dp_size_one_live_rank_of_three():
    ranks = [rank_row(0), rank_row(1, "stale"), rank_row(2, "empty")]
    f = one(check_dp_size(window(sample(0.0, ranks))), "one_live_rank")
    assert (f.severity, f.title) == ("critical", "only 1 of 3 ranks live (rank 0)")
    assert f.evidence == "at the end of the window: rank 1 stale; rank 2 empty"


def test_dp_size_no_live_rank():
    f = one(check_dp_size(window(sample(0.0, [rank_row(0, "torn"), rank_row(1, "empty")]))), "one_live_rank")
    assert f.title == "only 0 of 2 ranks live"


def test_dp_size_silent_with_two_live_ranks():
    assert check_dp_size(window(sample(0.0, [*live(2), rank_row(2, "stale")]))) == []


# -- stale and torn ----------------------------------------------------------------------------------


def test_stale_and_torn_with_their_pids():
    ranks = [rank_row(0), rank_row(1, "stale", age_s=2.5), rank_row(2, "empty"),
             rank_row(3, "torn", pid_alive=False), rank_row(4, "stale", pid=0, pid_alive=False, age_s=9.0)]
    f = one(check_stale_or_torn(window(sample(0.0, ranks), stale_after=2.0)), "stale_or_torn")
    assert (f.severity, f.title) == ("critical", "3 ranks stale or torn: 1, 3, 4")
    assert f.evidence == (f"rank 1 stale, last publish 2.5 s ago (pid {WRITER_PID} running); "
                          f"rank 3 torn (pid {WRITER_PID} gone); rank 4 stale, last publish 9.0 s ago (no writer) "
                          "(stale after 2 s)")


def test_a_stale_rank_whose_writer_runs_is_a_warning():
    f = one(check_stale_or_torn(window(sample(0.0, [rank_row(0), rank_row(1, "stale", age_s=1.5)]))),
            "stale_or_torn")
    assert (f.severity, f.title) == ("warning", "1 rank stale or torn: 1")


def test_stale_or_torn_silent_on_live_and_empty_slots():
    assert check_stale_or_torn(window(sample(0.0, [rank_row(0), rank_row(1, "empty")]))) == []


# -- the dispatch record -----------------------------------------------------------------------------


def test_record_refused_gives_the_refusal_as_evidence():
    f = one(check_record(window(sample(0.0, live(2), refused="/dev/shm/x: another user's"))), "record_refused")
    assert (f.severity, f.evidence) == ("warning", "/dev/shm/x: another user's")


def test_no_record_is_a_note():
    f = one(check_record(window(sample(0.0, live(2)))), "no_record")
    assert (f.severity, f.evidence) == ("info", f"board {BOARD!r} has no dispatch record")


@pytest.mark.parametrize("rows, evidence", [
    ([dispatch_row(2, alive=False, age_s=3.0)], "dispatch record rows: pid 5151 (gone, last publish 3.0 s ago)"),
    ([], "dispatch record rows: no row claimed"),
])
def test_record_silent_without_a_live_dispatcher(rows, evidence):
    f = one(check_record(window(sample(0.0, live(2), dispatch=rows))), "record_silent")
    assert (f.severity, f.evidence) == ("warning", evidence)


def test_record_rule_silent_with_a_live_dispatcher():
    assert check_record(window(sample(0.0, live(2), dispatch=[dispatch_row(2)]))) == []


# -- a PD prefill server on round robin --------------------------------------------------------------


def test_prefill_round_robin_once_per_dispatcher():
    rows = [dispatch_row(2, row=r, pid=600 + r, method="round_robin", mode="prefill") for r in range(2)]
    found = check_prefill_round_robin(window(sample(0.0, live(2), dispatch=rows)))
    assert [f.id for f in found] == ["prefill_round_robin"] * 2
    assert [f.evidence for f in found] == [
        f"dispatcher pid {600 + r}: method round_robin, disaggregation mode prefill" for r in range(2)]
    assert found[0].severity == "critical"


@pytest.mark.parametrize("method, mode, alive", [
    ("follow_bootstrap_room", "prefill", True), ("round_robin", "null", True), ("round_robin", "prefill", False)])
def test_prefill_round_robin_silent(method, mode, alive):
    rows = [dispatch_row(2, method=method, mode=mode, alive=alive)]
    assert check_prefill_round_robin(window(sample(0.0, live(2), dispatch=rows))) == []


# -- the PD rendezvous -------------------------------------------------------------------------------


def pd_board(transfer: int, *, prefill: dict | None = None, prefill_running: int = 0) -> list[dict]:
    """Ranks 0, 1 decode with ``transfer`` requests in their transfer queue; rank 2 prefill."""
    return [rank_row(0, pd=pd_queues("decode", transfer=transfer)),
            rank_row(1, pd=pd_queues("decode", transfer=transfer, prealloc=1)),
            rank_row(2, running=prefill_running, pd=prefill or pd_queues("prefill"))]


def test_pd_rendezvous_decode_queues_grow_while_prefill_idles():
    f = one(check_pd_rendezvous(window(sample(0.0, pd_board(1)), sample(2.0, pd_board(5)))), "pd_rendezvous")
    assert f.severity == "critical"
    assert f.evidence == ("decode transfer + prealloc queues grew over 2.0 s: rank 0 1 -> 5; rank 1 2 -> 6; "
                          "prefill rank 2 idle (nothing running, waiting or in flight)")


def test_pd_rendezvous_without_a_prefill_rank_on_the_board():
    start, end = pd_board(1)[:2], pd_board(3)[:2]
    f = one(check_pd_rendezvous(window(sample(0.0, start), sample(1.0, end))), "pd_rendezvous")
    assert f.evidence.endswith("; no prefill rank publishes on this board (check the prefill server's board)")


@pytest.mark.parametrize("end", [
    pd_board(1),  # the queues do not grow
    pd_board(5, prefill_running=1),  # prefill works
    pd_board(5, prefill=pd_queues("prefill", bootstrap=2)),  # prefill has requests waiting for their room
])
def test_pd_rendezvous_silent(end):
    assert check_pd_rendezvous(window(sample(0.0, pd_board(1)), sample(1.0, end))) == []


# -- KV saturation -----------------------------------------------------------------------------------


def test_kv_full_on_one_rank_only():
    ranks = [rank_row(0, used=9500), rank_row(1, used=2000), rank_row(2, used=8000)]
    f = one(check_kv_saturation(window(sample(0.0, ranks), sample(1.0, ranks))), "kv_saturation")
    assert (f.severity, f.title) == ("warning", "KV cache full on rank 0 only")
    assert f.evidence == "mean KV use over 1.0 s: rank 0 95%, rank 1 20%, rank 2 80%"


@pytest.mark.parametrize("used", [(9500, 9600), (9500, 8000), (2000, 3000)])
def test_kv_saturation_silent_unless_full_beside_roomy(used):
    ranks = [rank_row(k, used=u) for k, u in enumerate(used)]
    assert check_kv_saturation(window(sample(0.0, ranks))) == []


def test_kv_saturation_silent_with_one_live_rank():
    assert check_kv_saturation(window(sample(0.0, [rank_row(0, used=9900), rank_row(1, "stale", used=0)]))) == []


# -- routed_dp_rank ----------------------------------------------------------------------------------


def routed(requests: int, pinned: int) -> Window:
    """Of ``requests`` to three ranks, ``pinned`` carried routed_dp_rank=1; the others went to rank 0."""
    end = dispatch_row(3, requests=requests, routed=pinned, per_rank=[requests - pinned, pinned, 0],
                       routed_per_rank=[0, pinned, 0])
    return dispatched([dispatch_row(3)], [end])


def test_routed_one_rank():
    f = one(check_routed_one_rank(routed(100, 95)), "routed_one_rank")
    assert (f.severity, f.title) == ("critical", "95 % of requests routed to rank 1 by routed_dp_rank")
    assert f.evidence == "95 of 100 requests over 1.0 s carried routed_dp_rank=1; 95 % carried one at all"


@pytest.mark.parametrize("requests, pinned", [(100, 80), (9, 9)])
def test_routed_one_rank_silent_at_80_percent_or_under_10_requests(requests, pinned):
    assert check_routed_one_rank(routed(requests, pinned)) == []


# -- refreshes against the throttle ------------------------------------------------------------------


def refreshing(per_s: float, interval: float, method: str = "total_tokens") -> Window:
    """A dispatcher refreshing ``per_s`` times a second over 2 s while the ranks publish 50/s."""
    start = dispatch_row(2, method=method, refresh_interval=interval)
    end = dispatch_row(2, method=method, refresh_interval=interval, refreshes=int(2 * per_s))
    return window(sample(0.0, live(2, seq=1), dispatch=[start]), sample(2.0, live(2, seq=101), dispatch=[end]))


def test_refreshes_with_no_throttle():
    f = one(check_refresh_rate(refreshing(100, 0.0)), "refresh_rate")
    assert (f.severity, f.title) == ("warning", "refreshes 100/s with no throttle")
    assert f.evidence == ("dispatcher pid 5151 (total_tokens): 100.0 refreshes/s over 2.0 s, refresh interval 0 "
                          "(a refresh per dispatch); the ranks publish 50/s each")


def test_refreshes_above_the_throttle():
    f = one(check_refresh_rate(refreshing(200, 0.02)), "refresh_rate")
    assert f.title == "refreshes 200/s, above its throttle's 50/s"
    assert "200.0 refreshes/s over 2.0 s, refresh interval 20 ms;" in f.evidence


@pytest.mark.parametrize("per_s, interval, method", [
    (60, 0.02, "total_tokens"),  # within 1.25 x its throttle
    (40, 0.0, "total_tokens"),  # below SGLang's 50/s
    (1000, 0.0, "round_robin"),  # reads no loads: its refreshes do not matter
])
def test_refresh_rate_silent(per_s, interval, method):
    assert check_refresh_rate(refreshing(per_s, interval, method)) == []


# -- bootstrap rooms ---------------------------------------------------------------------------------


def rooms(per_rank: list[int], method: str = "follow_bootstrap_room") -> Window:
    start = dispatch_row(len(per_rank), method=method, mode="prefill")
    end = dispatch_row(len(per_rank), method=method, mode="prefill", per_rank=per_rank, requests=sum(per_rank),
                       with_room=sum(per_rank))
    return dispatched([start], [end])


def test_rooms_uneven():
    f = one(check_rooms_uneven(rooms([20, 0])), "rooms_uneven")
    assert f.severity == "warning"
    assert f.evidence == "requests per rank by room over 1.0 s: rank 0 20, rank 1 0 (max/mean 2.00); 100 % carried a room"


def test_rooms_uneven_when_a_rank_gets_none_at_a_ratio_under_the_skew():
    f = one(check_rooms_uneven(rooms([10, 10, 10, 0])), "rooms_uneven")
    assert "rank 3 0 (max/mean 1.33)" in f.evidence


@pytest.mark.parametrize("per_rank, method", [
    ([10, 10], "follow_bootstrap_room"), ([10, 10, 10, 7], "follow_bootstrap_room"), ([5, 4], "follow_bootstrap_room"), ([20, 0], "total_tokens")])
def test_rooms_uneven_silent(per_rank, method):
    assert check_rooms_uneven(rooms(per_rank, method)) == []


# -- rejections and fallbacks ------------------------------------------------------------------------


def counted(method: str = "total_tokens", **counts: int) -> Window:
    end = dispatch_row(2, method=method, requests=20, with_room=10, per_rank=[10, 10], **counts)
    return dispatched([dispatch_row(2, method=method)], [end])


def test_rejected_without_a_room():
    f = one(check_rejected(counted("follow_bootstrap_room", rejected=3)), "rejected")
    assert (f.severity, f.title) == ("warning", "3 requests rejected")
    assert f.evidence == "3 rejected beside 20 requests over 1.0 s (50 % of the dispatched carried a bootstrap_room)"
    assert "without a bootstrap_room" in f.cause and "router" in f.fix


def test_rejected_by_another_method():
    f = one(check_rejected(counted(rejected=1)), "rejected")
    assert "cannot place" in f.cause and "dispatcher's log" in f.fix


def test_fallbacks():
    f = one(check_fallbacks(counted(fallbacks=2)), "fallbacks")
    assert (f.severity, f.title) == ("warning", "2 requests placed by a fallback pick")
    assert f.evidence == "2 fallbacks beside 20 requests over 1.0 s"


def test_rejected_and_fallbacks_silent_at_0():
    assert check_rejected(counted()) == check_fallbacks(counted()) == []


# -- the method and the dispatch against the loads ---------------------------------------------------


def loaded(totals: list[int], method: str, per_rank: list[int]) -> Window:
    """Live ranks of ``totals`` tokens each (10,000 capacity), a dispatcher sending ``per_rank``."""
    ranks = [rank_row(k, total=t) for k, t in enumerate(totals)]
    end = dispatch_row(len(totals), method=method, per_rank=per_rank, requests=sum(per_rank))
    return dispatched([dispatch_row(len(totals), method=method)], [end], ranks=ranks)


def test_load_unaware_round_robin_under_skew():
    f = one(check_load_unaware_skew(loaded([100, 5000], "round_robin", [50, 50])), "load_unaware_skew")
    assert (f.severity, f.title) == ("warning", "load-unaware round_robin under skewed load")
    assert f.evidence == "mean total tokens over 1.0 s: rank 0 100, rank 1 5000 (max/mean 1.96)"
    assert "total_tokens" in f.fix


def test_load_unaware_follow_bootstrap_room_under_skew():
    f = one(check_load_unaware_skew(loaded([100, 5000], "follow_bootstrap_room", [50, 50])), "load_unaware_skew")
    assert f.title == "load-unaware follow_bootstrap_room under skewed load" and "rooms" in f.cause


@pytest.mark.parametrize("totals, method", [
    ([100, 5000], "total_tokens"),  # reads the loads
    ([1000, 1100], "round_robin"),  # even
    ([0, 150], "round_robin"),  # max/mean 2, but 150 tokens is under 2 % of the 10,000 capacity
])
def test_load_unaware_skew_silent(totals, method):
    assert check_load_unaware_skew(loaded(totals, method, [50, 50])) == []


def test_dispatch_one_sided_while_the_loads_are_even_from_the_boards_received_counts():
    start = [rank_row(0, received=0), rank_row(1, received=0)]
    end = [rank_row(0, received=180), rank_row(1, received=20)]
    f = one(check_dispatch_vs_load(window(sample(0.0, start), sample(1.0, end))), "dispatch_vs_load")
    assert (f.severity, f.title) == ("warning", "dispatch one-sided while the loads are even")
    assert f.evidence == "share of requests over 1.0 s: rank 0 90 %, rank 1 10 % (max/mean 1.80); mean loads max/mean 1.00"


def test_dispatch_even_while_the_loads_are_one_sided():
    f = one(check_dispatch_vs_load(loaded([100, 5000], "total_requests", [50, 50])), "dispatch_vs_load")
    assert f.title == "dispatch even while the loads are one-sided"
    assert f.evidence == ("share of requests over 1.0 s: rank 0 50 %, rank 1 50 %; mean total tokens rank 0 100, "
                          "rank 1 5000 (max/mean 1.96)")


@pytest.mark.parametrize("totals, method, per_rank", [
    ([100, 5000], "round_robin", [50, 50]),  # a load-unaware method: load_unaware_skew's finding
    ([1000, 1000], "total_tokens", [9, 9]),  # fewer than 10 requests per rank
    ([1000, 1000], "total_tokens", [55, 45]),  # both even
])
def test_dispatch_vs_load_silent(totals, method, per_rank):
    assert check_dispatch_vs_load(loaded(totals, method, per_rank)) == []


def test_dispatch_vs_load_leaves_a_routed_pinning_to_its_own_finding():
    w = routed(100, 95)
    assert [f.id for f in check_routed_one_rank(w)] == ["routed_one_rank"]
    assert check_dispatch_vs_load(w) == []


# -- requests in flight ------------------------------------------------------------------------------


def flying(dt: float, *, received_end: int = 7, in_flight: list[int] | None = None) -> Window:
    flights = in_flight if in_flight is not None else [3, 0]
    return window(sample(0.0, live(2, received=7), in_flight=flights),
                  sample(dt / 2, live(2, received=7), in_flight=flights),
                  sample(dt, [rank_row(0, received=received_end), rank_row(1, received=7)], in_flight=flights))


def test_requests_in_flight_that_never_arrive():
    f = one(check_inflight_stuck(flying(1.5)), "inflight_stuck")
    assert (f.severity, f.title) == ("warning", "requests sent and never received on rank 0")
    assert f.evidence == ("in flight (sent by the API servers less received by the engine) over 1.5 s, the "
                          "engine's received count unchanged: rank 0 3")


@pytest.mark.parametrize("w", [
    flying(0.5),  # under a second: requests on their way
    flying(1.5, received_end=9),  # the engine receives
    flying(1.5, in_flight=[0, 0]),
])
def test_inflight_stuck_silent(w):
    assert check_inflight_stuck(w) == []


def test_inflight_stuck_silent_without_a_sent_record():
    assert check_inflight_stuck(window(sample(0.0, live(2)), sample(2.0, live(2)))) == []


# -- no traffic --------------------------------------------------------------------------------------


def test_idle_dispatcher_is_a_note():
    f = one(check_idle(dispatched([dispatch_row(2)], [dispatch_row(2)], dt=3.0)), "idle")
    assert (f.severity, f.evidence) == ("info", "0 requests over 3.0 s")


def test_idle_silent_with_requests_or_without_a_record():
    assert check_idle(counted()) == []
    assert check_idle(window(sample(0.0, live(2)))) == []
