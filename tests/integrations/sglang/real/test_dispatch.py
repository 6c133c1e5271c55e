"""SGLang's real DataParallelController with and without DPBOARD_METHOD.

The controller is made by its own ``__init__`` and fed through its own request dispatcher; only
its scheduler launch is replaced (through SGLang's HookRegistry) by one that binds a real zmq PUSH
socket per rank, which this test reads back with a PULL socket per rank. Requests travel pickled,
as with SGLANG_USE_PICKLE_IPC.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from dpboard.controller import Dispatcher
from dpboard.errors import InvalidInputError
from tests.integrations.sglang.real.conftest import dpc, ls
from tests.support import sglang as sgl

pytestmark = pytest.mark.timeout(120)

io = sys.modules["sglang.srt.managers.io_struct"]
LAUNCH = "sglang.srt.managers.data_parallel_controller.DataParallelController.launch_dp_schedulers"
LAUNCH_DPA = "sglang.srt.managers.data_parallel_controller.DataParallelController.launch_dp_attention_schedulers"


def bind_workers(self, server_args, port_args):
    """Stand-in for the scheduler launch: a PUSH socket per rank, as SGLang binds for its schedulers."""
    for rank, endpoint in enumerate(port_args.worker_endpoints):
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        self.workers[rank] = sock


@pytest.fixture(scope="module", autouse=True)
def launch_without_processes(loaded_plugins):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(LAUNCH, bind_workers, HookType.REPLACE)
    HookRegistry.register(LAUNCH_DPA, bind_workers, HookType.REPLACE)  # under --enable-dp-attention
    HookRegistry.apply_hooks()
    assert LAUNCH in HookRegistry._patched and LAUNCH_DPA in HookRegistry._patched


@dataclass
class Cluster:
    controller: object
    pulls: list
    writers: list

    def send(self, req) -> None:
        self.controller._request_dispatcher(req)  # SGLang's own TypeBasedDispatcher

    def received(self, count: int = 1) -> dict[int, list[str]]:
        """rid per rank of the ``count`` requests the controller sent since the last call (and
        of any more that arrive meanwhile)."""
        out: dict[int, list[str]] = {}
        poller = zmq.Poller()
        for sock in self.pulls:
            poller.register(sock, zmq.POLLIN)
        got = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ready = dict(poller.poll(10 if got >= count else 100))
            if not ready and got >= count:
                break
            for rank, sock in enumerate(self.pulls):
                if sock in ready:
                    out.setdefault(rank, []).append(sock.recv_pyobj().rid)
                    got += 1
        return out


def req(rid: str, tokens: int = 10, routed: int | None = None):
    return io.TokenizedGenerateReqInput(rid=rid, input_ids=list(range(tokens)), routed_dp_rank=routed,
                                        bootstrap_room=None, time_stats=None)


def make_cluster(instance, tmp_path, method: str = "total_tokens", **context) -> Cluster:
    sgl.set_context(dp_size=3, load_balance_method=method, role="dp_controller", **context)
    args = instance.port_args
    args.scheduler_input_ipc_name = f"ipc://{tmp_path}/input"
    args.worker_endpoints = [f"ipc://{tmp_path}/worker{r}" for r in range(3)]
    writers = [ls.create_load_snapshot_writer(args, 3, r) for r in range(3)]
    controller = dpc.DataParallelController(sgl._plain("ServerArgs")(), args, sgl._nothing)
    context = zmq.Context.instance()
    pulls = []
    for endpoint in args.worker_endpoints:
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        pulls.append(sock)
    time.sleep(0.05)  # let the PULL sockets connect before the first send
    return Cluster(controller, pulls, writers)


def close(cluster: Cluster) -> None:
    for sock in cluster.pulls:
        sock.close(linger=0)
    cluster.controller.context.destroy(linger=0)


@contextlib.contextmanager
def dispatching(instance, tmp_path, monkeypatch, dpboard_method: str | None, *, stale_after: str | None = None,
                **kwargs) -> Iterator[Cluster]:
    """A cluster whose controller is made with DPBOARD_METHOD (None: unset, SGLang's own budget) and
    DPBOARD_STALE_AFTER as given; closed at the end."""
    if dpboard_method is not None:
        monkeypatch.setenv("DPBOARD_METHOD", dpboard_method)
    if stale_after is not None:
        monkeypatch.setenv("DPBOARD_STALE_AFTER", stale_after)
    cluster = make_cluster(instance, tmp_path, **kwargs)
    try:
        yield cluster
    finally:
        close(cluster)


def publish(cluster: Cluster, totals: dict[int, int], k: int = 1) -> None:
    import msgspec

    for rank, total in totals.items():
        snap = msgspec.structs.replace(sgl.full_snapshot(rank, k), num_total_tokens=total, num_used_tokens=total // 2,
                                       num_running_reqs=1, num_waiting_reqs=0)
        cluster.writers[rank].write(snap)


def test_without_dpboard_method_sglangs_budget_dispatches(instance, tmp_path, monkeypatch):
    with dispatching(instance, tmp_path, monkeypatch, None) as cluster:
        assert not hasattr(cluster.controller, "_dpboard_dispatch")
        publish(cluster, {0: 5000, 1: 900, 2: 3000})
        cluster.send(req("a", 10))
        assert cluster.received() == {1: ["a"]}
        # SGLang's DPBudget, refreshed from the board through the plugin's reader
        assert cluster.controller.dp_budget.total_tokens == [5000, 910, 3000]


def test_dpboard_method_routes_through_one_dispatcher(instance, tmp_path, monkeypatch):
    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens", stale_after="1.0") as cluster:
        c = cluster.controller
        dispatcher: Dispatcher = c._dpboard_dispatch.dispatcher
        assert dispatcher.method.value == "inflight_tokens" and dispatcher.num_workers == 3
        publish(cluster, {0: 5000, 1: 900, 2: 3000})
        cluster.send(req("a", 1000))  # 900 -> 1900: still the lightest
        cluster.send(req("b", 1000))  # 1900 -> 2900
        cluster.send(req("c", 1000))  # rank 1 at 2900 < 3000
        cluster.send(req("d", 500))  # now rank 2 (3000 < 3900)
        assert cluster.received(4) == {1: ["a", "b", "c"], 2: ["d"]}
        assert c.dp_budget.total_tokens == [0, 0, 0]  # SGLang's own budget is not read, nor charged
        assert list(dispatcher.budget.in_flight()) == [0, 3, 1]
        # SGLang's external routing is kept (its check and send), and charged to the dispatcher
        cluster.send(req("routed", 100, routed=0))
        assert cluster.received() == {0: ["routed"]}
        assert list(dispatcher.budget.in_flight()) == [1, 3, 1]
        with pytest.raises(ValueError, match="DP rank 7 is not active."):
            cluster.send(req("bad", 1, routed=7))
        # Health checks take SGLang's own round robin, outside the dispatcher's ledger
        cluster.send(req("HEALTH_CHECK_1", 1))
        assert sum(len(v) for v in cluster.received(1).values()) == 1
        assert list(dispatcher.budget.in_flight()) == [1, 3, 1]
        # The ranks report the requests they took in: nothing is in flight any more
        for rank, n in ((0, 1), (1, 3), (2, 1)):
            cluster.writers[rank].num_received_reqs += n
        publish(cluster, {0: 5100, 1: 3900, 2: 3500}, k=2)
        time.sleep(0.03)  # past the 20 ms throttle
        cluster.send(req("e", 10))
        assert cluster.received() == {2: ["e"]}
        assert list(dispatcher.budget.in_flight()) == [0, 0, 1]
        # SGLang marks rank 2 unavailable: the dispatcher follows
        c.update_active_ranks(io.ActiveRanksOutput(status=[True, True, False]))
        assert dispatcher.available == (True, True, False)
        cluster.send(req("f", 10))
        assert cluster.received() == {1: ["f"]}
        c.update_active_ranks(io.ActiveRanksOutput(status=[True, True, True]))
        # Rank 1's scheduler stops publishing: once stale it is no longer picked
        deadline = time.monotonic() + 1.3
        while time.monotonic() < deadline:
            publish(cluster, {0: 9000, 2: 8000}, k=3)
            time.sleep(0.05)
        rids = [f"g{i}" for i in range(4)]
        for rid in rids:
            cluster.send(req(rid, 10))
        got = cluster.received(4)
        assert 1 not in got and sorted(sum(got.values(), [])) == rids


def test_batches_refresh_once_and_follow_the_same_rules(instance, tmp_path, monkeypatch):
    with dispatching(instance, tmp_path, monkeypatch, "total_tokens") as cluster:
        publish(cluster, {0: 100, 1: 200, 2: 300})
        batch = io.BatchTokenizedGenerateReqInput(req(f"b{i}", 150) for i in range(4))
        cluster.send(batch)  # SGLang's dispatch_batch_generate: one refresh, then each request
        # seed total_tokens: 100 -> 250 (rank 0), 200 -> 350 (rank 1), 250 -> 400 (rank 0), 300 -> 450 (rank 2)
        assert cluster.received(4) == {0: ["b0", "b2"], 1: ["b1"], 2: ["b3"]}


def test_dpboard_method_needs_a_load_aware_sglang_method(instance, tmp_path, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_backlog")
    with pytest.raises(InvalidInputError, match="--load-balance-method total_tokens"):
        make_cluster(instance, tmp_path, method="round_robin")


def test_a_bad_dpboard_method_is_a_clear_error(instance, tmp_path, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "fastest")
    with pytest.raises(InvalidInputError, match="DPBOARD_METHOD='fastest'"):
        make_cluster(instance, tmp_path)


def test_with_every_rank_stale_requests_still_go_out_and_are_counted(instance, tmp_path, monkeypatch):
    """One long step stalls every DP-attention rank past DPBOARD_STALE_AFTER: the dispatcher then has
    no live rank, and its UnavailableError once went up through SGLang's _request_dispatcher (SGLang's
    controller then sends SIGQUIT to its parent: the whole server dies). SGLang's own budget never
    raises there; the plugin falls back to the pick SGLang's budget would make, and counts it."""
    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens", stale_after="0.05") as cluster:
        c = cluster.controller
        publish(cluster, {0: 5000, 1: 900, 2: 3000})
        cluster.send(req("live", 10))
        assert cluster.received() == {1: ["live"]} and c._dpboard_dispatch.fallbacks == 0
        time.sleep(0.3)  # no rank publishes: every one is stale at the next refresh
        for i in range(3):
            cluster.send(req(f"stale{i}", 2000))
        got = cluster.received(3)
        # The lightest by the last-known loads first, each pick charged: 910 -> 2910, then 2910 < 3000, ...
        assert got == {1: ["stale0", "stale1"], 2: ["stale2"]}
        assert c._dpboard_dispatch.fallbacks == 3
        publish(cluster, {0: 100, 1: 9000, 2: 9000}, k=2)  # the ranks come back: the dispatcher decides again
        time.sleep(0.03)
        cluster.send(req("back", 10))
        assert cluster.received() == {0: ["back"]} and c._dpboard_dispatch.fallbacks == 3


def test_follow_bootstrap_room_without_pd_is_refused_at_start(instance, tmp_path, monkeypatch):
    """Accepted at start, it once stopped the server on the first ordinary request (no bootstrap_room)."""
    monkeypatch.setenv("DPBOARD_METHOD", "follow_bootstrap_room")
    with pytest.raises(InvalidInputError, match="needs PD disaggregation .* disaggregation mode 'null'"):
        make_cluster(instance, tmp_path)


def test_inflight_wave_is_refused_when_the_plugin_was_loaded_without_it(instance, tmp_path, monkeypatch):
    """The loop's receive is hooked at the plugin's load only for a holding DPBOARD_METHOD (every
    receive pays for it): set later, in a process that loaded the plugin without it, nothing would look
    at a held request again, so the controller refuses to start."""
    from dpboard.integrations.sglang import dispatch

    monkeypatch.setattr(dispatch, "_ticks", False)  # what register() leaves for a method that holds nothing
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_wave")
    with pytest.raises(InvalidInputError, match="inflight_wave holds requests for waves, but the plugin was "
                                                "loaded .* set DPBOARD_METHOD before SGLang starts"):
        make_cluster(instance, tmp_path)


@pytest.mark.parametrize(("name", "value", "why"), [("DPBOARD_WAVE_MAX_HOLD", "61", "seconds"),
                                                    ("DPBOARD_WAVE_MAX_HOLD", "soon", "not a number"),
                                                    ("DPBOARD_WAVE_PER_RANK", "0", "per rank"),
                                                    ("DPBOARD_WAVE_PER_RANK", "2.5", "per rank")])
def test_a_wave_setting_outside_its_bounds_is_refused_at_start_naming_the_variable(instance, tmp_path,
                                                                                   monkeypatch, name, value, why):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_wave")
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError, match=rf"{name}='{value}': .*{why}.*; unset it for the default"):
        make_cluster(instance, tmp_path)


@pytest.mark.parametrize("value", ["1e-300", "0.001", "inf", "1e7", "nan"])
def test_a_stale_after_outside_its_bounds_is_refused_at_start_naming_the_variable(instance, tmp_path,
                                                                                  monkeypatch, value):
    """1e-300 had every rank stale at every read; inf and 1e7 passed the settings and failed later,
    in the board's reader, with a message that did not name the variable."""
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_tokens")
    monkeypatch.setenv("DPBOARD_STALE_AFTER", value)
    with pytest.raises(InvalidInputError, match=rf"DPBOARD_STALE_AFTER='{value}' must be a number of seconds in "
                                                r"\[0.01, 1e\+06\]"):
        make_cluster(instance, tmp_path)


def test_an_exception_in_dpboards_pick_is_answered_by_sglangs_own_dispatch(instance, tmp_path, monkeypatch, caplog):
    """A bug in dpboard's pick (the dispatcher raising something that is not a DpboardError) once
    went up through SGLang's _request_dispatcher, which stops the whole server. SGLang's own
    dispatch now places the request, and the controller's session counts it (``faults``, a fallback in
    the dispatch record) and logs it at the 1st, 10th, ... time, the first with its traceback."""
    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens") as cluster:
        c = cluster.controller
        publish(cluster, {0: 5000, 1: 900, 2: 3000})

        def broken(request):
            raise RuntimeError("injected")

        monkeypatch.setattr(c._dpboard_dispatch.dispatcher, "dispatch", broken)
        with caplog.at_level("WARNING", logger="dpboard.sglang"):
            for i in range(10):
                cluster.send(req(f"f{i}", 10))
            got = cluster.received(10)
        assert sorted(r for rids in got.values() for r in rids) == sorted(f"f{i}" for i in range(10))
        session = c._dpboard_dispatch
        assert session.faults == 10 and session.fallbacks == 10 and session.tally.fallbacks == 10
        said = [r for r in caplog.records if "injected" in r.getMessage()]
        assert ["#1" in said[0].getMessage(), "#10" in said[1].getMessage()] == [True, True] and len(said) == 2
        assert said[0].exc_info is not None and said[1].exc_info is None


def test_auto_under_dp_attention_dispatches_with_inflight_lockstep(instance, tmp_path, monkeypatch):
    # SGLang divided --chunked-prefill-size 8192 by the 3 DP ranks: each rank's writer publishes that
    with dispatching(instance, tmp_path, monkeypatch, "auto", attn_dp_enabled=True, chunked_prefill_size=2730) as cluster:
        dispatcher: Dispatcher = cluster.controller._dpboard_dispatch.dispatcher
        assert dispatcher.method.value == "inflight_lockstep"
        import msgspec

        # rank 0 runs 30 decodes, rank 1 one, rank 2 ten; nothing is queued anywhere
        for rank, running in {0: 30, 1: 1, 2: 10}.items():
            snap = msgspec.structs.replace(sgl.full_snapshot(rank, 1), num_running_reqs=running, num_waiting_reqs=0,
                                           num_waiting_uncached_tokens=0, num_total_tokens=1000, num_used_tokens=1000,
                                           max_total_num_tokens=100_000)
            # colocated: no rank serves one side of PD (full_snapshot varies the mode by rank)
            snap = msgspec.structs.replace(snap, disaggregation=msgspec.structs.replace(snap.disaggregation,
                                                                                        mode="null"))
            cluster.writers[rank].write(snap)
        for i in range(3):
            cluster.send(req(f"r{i}", 100))
        # three 100-token prompts share one chunk on rank 1, where a prefill stalls one decode
        assert cluster.received(3) == {1: ["r0", "r1", "r2"]}
        assert dispatcher.budget.chunk.tolist() == [2730, 2730, 2730]


@pytest.mark.parametrize("delayer", [None, False, True], ids=["unset", "off", "on"])
def test_beside_sglangs_prefill_delayer_the_lockstep_horizon_is_two_steps(instance, tmp_path, monkeypatch, caplog,
                                                                           delayer):
    # --enable-prefill-delayer holds prefill back until the ranks prefill together: a shorter horizon
    with caplog.at_level("INFO", logger="dpboard.sglang"), dispatching(
            instance, tmp_path, monkeypatch, "auto", attn_dp_enabled=True, chunked_prefill_size=2730,
            enable_prefill_delayer=delayer) as cluster:
        dispatcher: Dispatcher = cluster.controller._dpboard_dispatch.dispatcher
        horizon = 2 if delayer else 6
        assert dispatcher.method.value == "inflight_lockstep" and dispatcher.lockstep_horizon == horizon
        assert dispatcher.budget.core.horizon == horizon
        said = [r.getMessage() for r in caplog.records if "DP dispatch by" in r.getMessage()]
        assert said and f"inflight_lockstep (horizon {horizon} group steps)" in said[-1]


def test_auto_without_dp_attention_keeps_round_robin(instance, tmp_path, monkeypatch):
    with dispatching(instance, tmp_path, monkeypatch, "auto") as cluster:
        assert cluster.controller._dpboard_dispatch.dispatcher.method.value == "round_robin"
