"""Scheduler processes and a reader process, as SGLang runs them: several writers (each its own
process, loading the plugin through SGLang's loader) and this process reading through SGLang's
factory; SGLang's own DPBudget fed by the board picks what it picks fed by SGLang's own file."""

from __future__ import annotations

import sys
import time

import pytest

from dpboard import Board
from tests.integrations.sglang.real.conftest import dpc, ls
from tests.support import sglang as sgl
from tests.support.procutil import wait_for
from tests.support.sglang_proc import SchedulerProc

pytestmark = pytest.mark.timeout(180)


def make_board_in_main_process(instance) -> None:
    """What SGLang's main process does first: make the port args (the plugin makes the board then)."""
    sgl.set_context(dp_size=instance.dp_size, role="tokenizer")
    sys.modules["sglang.srt.server_args"].PortArgs.init_new(server_args=None)
    sgl.set_context(dp_size=instance.dp_size, role="dp_controller")


def test_writer_processes_and_a_reader(instance):
    make_board_in_main_process(instance)
    procs = [SchedulerProc("plugin", str(r), "3", instance.port_args.instance_id) for r in range(3)]
    try:
        reader = ls.create_load_snapshot_reader(instance.port_args, caller="DataParallelController")
        board = Board.attach(instance.board)
        try:
            for p in procs:
                assert board.owner_pid(procs.index(p)) == p.proc.pid
            for k in (1, 2, 3):
                for r, p in enumerate(procs):
                    p.send(op="take", n=r + k)
                    p.publish(k)
                loads = reader.read_all()
                assert [s.dp_rank for s in loads] == [0, 1, 2]
                for snap in loads:
                    assert snap.to_dict(include={"all"}) == sgl.full_snapshot(snap.dp_rank, k).to_dict(include={"all"})
                received = [board.reader().read(r).num_received_reqs for r in range(3)]
                assert received == [sum(r + j for j in range(1, k + 1)) for r in range(3)]
        finally:
            board.close()
        for p in procs:
            p.close()
            assert p.proc.returncode == 0
        # The board outlives its writers: the server's main process owns it.
        assert [s.dp_rank for s in reader.read_all()] == [0, 1, 2]
    finally:
        for p in procs:
            p.kill()


def test_sglangs_dpbudget_picks_alike_and_after_a_rank_is_killed(instance, monkeypatch, tmp_path):
    """SGLang's real DPBudget, refreshed from the board through the plugin's reader and from SGLang's
    own file through its own reader, with the same publishes from writer processes: the same picks,
    before and after rank 1's scheduler is killed (SIGKILL). SGLang's budget keeps a rank it no longer
    hears of where it was, plus its own charges, in both cases; the board also stops showing it."""
    monkeypatch.setenv("DPBOARD_STALE_AFTER", "0.3")
    make_board_in_main_process(instance)
    path = str(tmp_path / "sglang_loads.shm")
    ours = [SchedulerProc("plugin", str(r), "3", instance.port_args.instance_id) for r in range(3)]
    theirs = [SchedulerProc("sglang", path, "3", str(r)) for r in range(3)]
    try:
        our_reader = ls.create_load_snapshot_reader(instance.port_args, caller="DataParallelController")
        their_reader = ls.ShmLoadSnapshotReader(path, 3)
        budgets = dpc.DPBudget(3), dpc.DPBudget(3)
        picks: tuple[list, list] = ([], [])

        def step(k: int, loads: dict[int, int], alive: tuple[int, ...] = (0, 1, 2)) -> None:
            for r in alive:
                for procs in (ours, theirs):
                    procs[r].publish(k, num_total_tokens=loads[r], num_running_reqs=r, num_waiting_reqs=k)
            for budget, reader, out in zip(budgets, (our_reader, their_reader), picks, strict=True):
                budget.update_budget(reader.read_all())
                for tokens in (300, 100, 700, 50, 250):
                    out.append(budget.dispatch(dpc.LoadBalanceMethod.TOTAL_TOKENS, estimated_tokens=tokens))
                out.append(budget.dispatch(dpc.LoadBalanceMethod.TOTAL_REQUESTS))

        step(1, {0: 4000, 1: 1000, 2: 2500})
        step(2, {0: 1200, 1: 1300, 2: 5000})
        assert picks[0] == picks[1]
        assert {1} < set(picks[0])
        ours[1].kill()
        theirs[1].kill()
        time.sleep(0.4)  # past DPBOARD_STALE_AFTER: rank 1 is stale on the board
        for k in (3, 4, 5):
            step(k, {0: 3000 + 100 * k, 2: 2000 - 100 * k}, alive=(0, 2))
        assert picks[0] == picks[1]
        assert budgets[0].total_tokens == budgets[1].total_tokens
        assert budgets[0].total_requests == budgets[1].total_requests
        # What each reader shows of the dead rank: SGLang's file still holds its last snapshot;
        # the board hands it over as an unpublished rank.
        assert [s.dp_rank for s in their_reader.read_all()] == [0, 1, 2]
        assert [s.dp_rank for s in our_reader.read_all()] == [0, 2] and our_reader.read(1) is None
        their_reader.close()
    finally:
        for p in ours + theirs:
            p.kill()


def test_a_writer_killed_mid_write_is_torn_and_left_out(instance):
    """A scheduler killed in the middle of a publish leaves its slot odd (TORN); SGLang's callers get
    it as an unpublished rank, and a new writer of the rank makes the slot whole again."""
    from dpboard.snapshot import SlotStatus

    make_board_in_main_process(instance)
    board = Board.attach(instance.board)
    procs = [SchedulerProc("plugin", str(r), "3", instance.port_args.instance_id) for r in range(3)]
    try:
        for p in procs:
            p.publish(1)
        reader = ls.create_load_snapshot_reader(instance.port_args, caller="TokenizerManager")
        assert [s.dp_rank for s in reader.read_all()] == [0, 1, 2]
        procs[2].send(op="tear")
        wait_for(lambda: board.reader().status(2) == SlotStatus.TORN, 10, "slot 2 to be mid-write")
        procs[2].kill()
        assert board.reader().status(2) == SlotStatus.TORN
        assert reader.read(2) is None and [s.dp_rank for s in reader.read_all()] == [0, 1]
        again = SchedulerProc("plugin", "2", "3", instance.port_args.instance_id)  # the rank's restart
        procs.append(again)
        again.publish(7)
        assert reader.read(2).to_dict() == sgl.full_snapshot(2, 7).to_dict()
    finally:
        for p in procs:
            p.kill()
        board.close()
