"""SGLang's real DataParallelController with DPBOARD_METHOD publishes its dispatch record: what
``dpboard doctor`` reads of the method, the routed share and the fallbacks."""

from __future__ import annotations

import time

import pytest

from dpboard.board.dispatch_record import read_dispatch_record
from dpboard.views.doctor import diagnose, take_sample
from tests.integrations.sglang.real.test_dispatch import dispatching, launch_without_processes, publish, req

pytestmark = pytest.mark.timeout(120)
__all__ = ["launch_without_processes"]  # the module's fixture: SGLang's scheduler launch replaced


def _record(cluster):
    return read_dispatch_record(cluster.writers[0].board_name)


def test_the_plugins_dispatcher_publishes_its_counts(instance, tmp_path, monkeypatch):
    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens") as cluster:
        publish(cluster, {0: 5000, 1: 900, 2: 3000})
        for i in range(9):
            cluster.send(req(f"r{i}", 10, routed=2))
        cluster.send(req("free", 10))
        with pytest.raises(ValueError):
            cluster.send(req("bad", 1, routed=7))
        assert sum(len(v) for v in cluster.received(10).values()) == 10
        time.sleep(0.12)  # past the record's publish interval: the next refresh publishes what came before
        cluster.send(req("last", 10))
        cluster.received(1)
        (row,) = _record(cluster)
        assert (row.method, row.mode, row.refresh_interval) == ("inflight_tokens", "null", 0.02)
        assert row.counts["requests"] == 10 and row.counts["routed"] == 9 and row.counts["rejected"] == 1
        assert row.per_rank[2] == 9 and row.routed_per_rank == [0, 0, 9]
        assert row.counts["refreshes"] >= 1


def test_an_idle_controllers_last_picks_reach_the_record(instance, tmp_path, monkeypatch):
    """SGLang's own event loop turns (its receive finds nothing): the last picks of a burst reach the
    record within the tally's 0.1 s though no later pick or refresh comes to publish them."""
    from tests.integrations.sglang.real.test_wave import looping
    from tests.support.procutil import wait_until

    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens") as cluster:
        publish(cluster, {0: 5000, 1: 900, 2: 3000})
        with looping(cluster) as push:
            for i in range(7):
                push.send_pyobj(req(f"r{i}", 10))
            assert sum(len(v) for v in cluster.received(7).values()) == 7
            assert wait_until(lambda: _record(cluster)[0].counts["requests"] == 7, timeout=5), _record(cluster)


def test_doctor_names_routed_dp_rank_behind_the_plugins_dispatch(instance, tmp_path, monkeypatch):
    from dpboard import Board

    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens") as cluster:
        name = cluster.writers[0].board_name
        publish(cluster, {0: 100, 1: 100, 2: 100})
        board = Board.attach(name)
        reader = board.reader(stale_after=5.0)
        first = take_sample(board, reader)
        for i in range(40):
            cluster.send(req(f"r{i}", 10, routed=0 if i % 20 else None))
        cluster.received(40)
        time.sleep(0.12)  # past the publish interval: routed requests tick the record every 32
        for i in range(40):
            cluster.send(req(f"s{i}", 10, routed=0))
        cluster.received(40)
        last = take_sample(board, reader)
        board.close()
        found = {f.id: f for f in diagnose([first, last], stale_after=5.0)}
        assert "routed_one_rank" in found and "rank 0" in found["routed_one_rank"].title


def test_fallback_picks_are_counted_in_the_record(instance, tmp_path, monkeypatch):
    """Every rank stale: the plugin places requests by its fallback pick, and its row says how many."""
    with dispatching(instance, tmp_path, monkeypatch, "inflight_tokens", stale_after="0.05") as cluster:
        publish(cluster, {0: 5000, 1: 900, 2: 3000})
        cluster.send(req("live", 10))
        time.sleep(0.3)  # no rank publishes: every one is stale at the next refresh
        for i in range(3):
            cluster.send(req(f"stale{i}", 2000))
        time.sleep(0.12)  # past the record's publish interval: the next refresh publishes what came before
        cluster.send(req("stale3", 10))
        assert sum(len(v) for v in cluster.received(5).values()) == 5
        (row,) = _record(cluster)
        assert row.counts["fallbacks"] == 3 and row.counts["requests"] == 4
