"""The method table (``METHODS``, dpboard/methods.py): every row is what the Dispatcher does
with a request, the C core's key ids are the table's keys, and ``auto`` reads its picks from the rows.

One cluster of five ranks is built so that each argmin key picks a different rank; a row's pick is
then the one its key (or, for the methods that read no load, its delivery) names."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from dpboard import LoadSnapshot
from dpboard.controller import Dispatcher, DPBudget, LoadBalanceMethod, resolve_load_balance_method
from dpboard.controller import budget as budget_module
from dpboard.controller.dispatcher import _PLACEMENTS
from dpboard.methods import AUTO_PICKS, METHOD_CHOICES, METHODS, ArgminKey, Delivery, Deployment
from tests.support.dispatch import FakeClock, ListReader, TokReq

BOTH = pytest.mark.parametrize("use_extension", [True, False], ids=["c", "python"])
KV = 10_000
CHUNK = 100  # lockstep_chunk: a rank's prefill chunk when its board publishes none
# (running, waiting, used, total) per rank; each rank's KV holds 10 000 tokens
CLUSTER = [
    (0, 0, 1000, 9000),  # the fewest requests; 8000 tokens queued
    (1, 0, 0, 800),  # the fewest tokens
    (2, 0, 9950, 9950),  # nothing queued, but a 100-token prompt overflows its KV
    (20, 0, 3000, 3100),  # the smallest queue with room (first token in 2 chunks), 20 decodes running
    (0, 3, 3000, 3300),  # first token in 4 chunks, within the horizon, and no decode to stall
]
BY_KEY = {ArgminKey.REQUESTS: 0, ArgminKey.TOKENS: 1, ArgminKey.BACKLOG: 2, ArgminKey.HEADROOM: 3,
          ArgminKey.LOCKSTEP: 4}
ROOM = 7
BY_DELIVERY = {Delivery.ROUND_ROBIN: 0, Delivery.ROOM: ROOM % len(CLUSTER)}


def snapshots(seq: int = 1) -> list[LoadSnapshot]:
    return [LoadSnapshot(dp_rank=r, num_running_reqs=run, num_waiting_reqs=wait, num_used_tokens=used,
                         num_total_tokens=total, max_total_num_tokens=KV, publish_seq=seq, timestamp_ns=seq)
            for r, (run, wait, used, total) in enumerate(CLUSTER)]


def expected_pick(method: LoadBalanceMethod) -> int:
    spec = METHODS[method]
    return BY_DELIVERY[spec.delivery] if spec.key is None else BY_KEY[spec.key]


def dispatcher(method: LoadBalanceMethod, use_extension: bool) -> tuple[Dispatcher, ListReader]:
    reader = ListReader(len(CLUSTER))
    reader.snaps = snapshots()
    d = Dispatcher(method, len(CLUSTER), reader=reader if METHODS[method].is_load_aware else None,
                   clock=FakeClock(), lockstep_chunk=CHUNK, use_extension=use_extension)
    return d, reader


def test_every_key_has_a_case_and_every_method_a_row():
    assert set(BY_KEY) == set(ArgminKey) and len(set(BY_KEY.values())) == len(ArgminKey)
    assert list(METHODS) == list(LoadBalanceMethod)
    assert METHOD_CHOICES == ("auto", *(m.value for m in LoadBalanceMethod))


@BOTH
def test_each_key_id_picks_what_its_key_says_in_both_cores(use_extension):
    # the id the table gives a key (ArgminKey's value) is the one the C core runs that key for
    core_type = budget_module.ArgminCore if use_extension else budget_module.PyArgminCore
    for key, rank in BY_KEY.items():
        b = DPBudget(len(CLUSTER), key=key, lockstep_chunk=CHUNK, lockstep_horizon=6, use_extension=use_extension)
        assert type(b.core) is core_type
        b.update_budget(snapshots())
        assert b.core.key == key.value
        assert b.core.pick(TokReq(100)) == rank, key
    with pytest.raises(ValueError, match=r"key must be one of the KEY_\* constants \(0..4\), got 5"):
        b.core.key = len(ArgminKey)


def test_the_c_core_exports_the_tables_key_ids():
    from dpboard.controller import _dispatch

    compiled = {name: getattr(_dispatch, name) for name in dir(_dispatch) if name.startswith("KEY_")}
    assert compiled == {f"KEY_{key.name}": key.value for key in ArgminKey}


@BOTH
@pytest.mark.parametrize("method", list(METHODS))
def test_every_row_is_what_the_dispatcher_does(method, use_extension):
    spec = METHODS[method]
    d, reader = dispatcher(method, use_extension)
    assert d.spec is spec
    req = TokReq(100, bootstrap_room=ROOM)
    assert d.dispatch(req) == expected_pick(method)
    assert dispatcher(method, use_extension)[0].dispatch_batch([req]) == [expected_pick(method)]
    assert (d.budget is not None) == spec.is_load_aware and (d.prefix is not None) == spec.uses_prefix_index
    assert (d.inflight_accounting, d.health_aware, d.rotate_ties) == (
        spec.inflight_accounting, spec.health_aware, spec.rotate_ties)
    if not spec.is_load_aware:
        return
    # the row's in-flight default: a snapshot that has not counted the request yet keeps it (accounting),
    # or overwrites the speculative charge (SGLang)
    rank = expected_pick(method)
    reader.snaps = snapshots(seq=2)
    d.refresh()
    running, waiting = CLUSTER[rank][:2]
    assert int(d.budget.total_requests[rank]) == running + waiting + spec.inflight_accounting


def test_each_delivery_is_placed_by_its_one_pair():
    # the Dispatcher's one switch on how a request is placed: a dispatcher is made with its delivery's
    # pair as its dispatch and dispatch_batch (no switch per call); on the class, they run that pair
    assert set(_PLACEMENTS) == set(Delivery)
    req = TokReq(100, bootstrap_room=ROOM)
    for method, spec in METHODS.items():
        one, batch = _PLACEMENTS[spec.delivery]
        d = dispatcher(method, True)[0]
        assert d.dispatch.__func__ is one and d.dispatch_batch.__func__ is batch
        assert Dispatcher.dispatch(d, req) == expected_pick(method)
        assert Dispatcher.dispatch_batch(dispatcher(method, True)[0], [req]) == [expected_pick(method)]


def test_auto_is_the_row_that_lists_the_deployment():
    cases = {Deployment.NO_PD: ("null", False), Deployment.LOCKSTEP: ("null", True),
             Deployment.PD_PREFILL: ("prefill", True), Deployment.PD_DECODE: ("decode", True)}
    assert set(cases) == set(Deployment) == set(AUTO_PICKS)
    for where, (mode, lockstep) in cases.items():
        (listed,) = [m for m, spec in METHODS.items() if where in spec.auto_for]
        assert resolve_load_balance_method("auto", mode, lockstep=lockstep) is listed
        assert Dispatcher("auto", 2, reader=ListReader(2), disaggregation_mode=mode, lockstep=lockstep).method is listed
    with pytest.warns(UserWarning, match="round_robin does not map bootstrap_room stably"):
        assert resolve_load_balance_method("round_robin", "prefill") is AUTO_PICKS[Deployment.PD_PREFILL]


@BOTH
def test_the_cores_throttle_refreshes_once_per_interval(use_extension):
    clock = FakeClock()
    b = DPBudget(2, clock=clock, refresh_interval=0.02, use_extension=use_extension)
    assert b.core.pick_fresh(TokReq(1)) is None  # the first pick refreshes first
    assert b.core.pick_fresh(TokReq(1)) == 0 and not b.core.refresh_due()
    clock.now += 0.019
    assert b.core.pick_fresh(TokReq(1)) == 1
    clock.now += 0.002
    assert b.core.refresh_due() and b.core.last_refresh == clock.now and not b.core.refresh_due()
    assert DPBudget(2, use_extension=use_extension).core.refresh_due() is False  # no clock: never due


def test_a_dispatcher_whose_clock_holds_it_is_freed():
    # the simulator's clock is a method of the simulation that holds the dispatcher: the C core,
    # which keeps the clock, must let the garbage collector free that cycle
    class Simulation:
        def __init__(self) -> None:
            self.now = 1.0
            self.dispatcher = Dispatcher("total_tokens", 2, reader=ListReader(2), clock=self.clock)

        def clock(self) -> float:
            return self.now

    owner = Simulation()
    assert owner.dispatcher.dispatch(TokReq(5)) in (0, 1)
    gone = weakref.ref(owner.dispatcher.budget)
    del owner
    gc.collect()
    assert gone() is None


def test_the_python_twin_refuses_a_key_without_its_arrays():
    z8, z1 = np.zeros(2, np.int64), np.ones(2, np.uint8)
    arrays = SimpleNamespace(total_tokens=z8, total_requests=z8.copy(), candidate=z1, routable=z1.copy(),
                             sent_reqs=z8.copy(), sent_tokens=z8.copy(), backlog=z8.copy())
    for core_type in (budget_module.ArgminCore, budget_module.PyArgminCore):
        with pytest.raises(ValueError, match="key HEADROOM needs the backlog and capacity arrays"):
            core_type(arrays, key=ArgminKey.HEADROOM)
        core = core_type(arrays, key=ArgminKey.BACKLOG)
        with pytest.raises(ValueError, match="key LOCKSTEP needs the backlog, capacity, running and chunk"):
            core.key = ArgminKey.LOCKSTEP
        assert core.key == ArgminKey.BACKLOG
