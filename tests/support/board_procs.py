"""Processes that the board tests start: real writers and readers in their own interpreters.

Run as ``python tests/support/board_procs.py ROLE BOARD ...``; each role prints one JSON line when done.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from dpboard import Board, LoadSnapshot
from dpboard.snapshot import (
    DETAILED_DTYPE,
    DisaggregationDetail,
    LoadDetail,
    MemoryDetail,
    QueueDetail,
    SpeculativeDetail,
    unpack_detail,
)


def consistent_snapshot(rank: int, k: int) -> LoadSnapshot:
    """A snapshot whose fields all derive from one counter k, so a reader can check them against
    each other: any mix of two writes breaks at least one relation."""
    return LoadSnapshot(
        dp_rank=rank,
        num_running_reqs=k,
        num_waiting_reqs=(k * 7 + rank) % 1_000_003,
        num_used_tokens=k * 3,
        num_total_tokens=k * 3 + 11,
        num_active_tokens=k ^ 0x5A5A5A,
        max_total_num_tokens=2**62 - k,
        num_received_reqs=k * 2,
    )


def check_snapshot(snap: LoadSnapshot) -> bool:
    k = snap.num_running_reqs
    return snap == consistent_snapshot(snap.dp_rank, k)._replace(
        **{f: getattr(snap, f) for f in LoadSnapshot._fields[8:]}
    ) and snap.publish_seq >= 1


def consistent_detail(k: int) -> LoadDetail | None:
    """A detail derived from k like consistent_snapshot, with sections present or not by k, and none
    at all for every fifth k (a plain publish, which clears the detail)."""
    if k % 5 == 0:
        return None
    return LoadDetail(
        timestamp=k * 0.5,
        num_waiting_uncached_tokens=k + 1,
        max_running_requests=k * 4,
        token_usage=k / 1e6,
        total_prefill_busy_us=k * 9,
        decode_moments=tuple(float(k + i) for i in range(6)) if k % 3 else None,
        memory=MemoryDetail(k * 1.0, k * 2.0, k * 3.0, k * 4) if k % 2 == 0 else None,
        speculative=SpeculativeDetail(k * 0.25, 0.5) if k % 2 else None,
        disaggregation=DisaggregationDetail("prefill" if k % 2 else "decode", k, k + 1, k + 2, k + 3, k + 4,
                                            k * 0.1, k * 0.2),
        queues=QueueDetail(k, k + 1, k + 2, k + 3, k + 4) if k % 7 else None,
    )


def _publish_for(board_name: str, rank: int, seconds: float, batch: int, publish_one) -> int:
    """``publish_one(writer, k)`` for k = 1, 2, ..., the clock read every ``batch`` publishes, until
    ``seconds`` have passed; the number of publishes."""
    board = Board.attach(board_name)
    w = board.writer(rank)
    deadline = time.monotonic() + seconds
    k = 0
    while time.monotonic() < deadline:
        for _ in range(batch):
            k += 1
            publish_one(w, k)
    return k


def _publish_consistent_detail(w, k: int) -> None:
    detail = consistent_detail(k)
    if detail is None:
        w.publish(consistent_snapshot(w.rank, k))
    else:
        w.publish_detailed(consistent_snapshot(w.rank, k), detail)


def detailed_writer(board_name: str, rank: int, seconds: float) -> None:
    k = _publish_for(board_name, rank, seconds, 200, _publish_consistent_detail)
    print(json.dumps({"role": "detailed_writer", "rank": rank, "publishes": k}), flush=True)


def detailed_reader(board_name: str, seconds: float) -> None:
    """Reads fields and details together (one slot, and every slot at once) and checks that both
    come from the same write."""
    board = Board.attach(board_name)
    r = board.reader()
    out = np.zeros(board.n_slots, DETAILED_DTYPE)
    deadline = time.monotonic() + seconds
    reads = bad = 0
    while time.monotonic() < deadline:
        for rank in range(board.n_slots):
            _, snap, detail = r.read_detail(rank)
            if snap is None:
                continue
            reads += 1
            bad += not check_snapshot(snap) or detail != consistent_detail(snap.num_running_reqs)
        for rec in r.read_detailed_array(out):
            if rec["load"]["status"] != 1:
                continue
            reads += 1
            k = int(rec["load"]["num_running_reqs"])
            bad += unpack_detail(rec["detail"]) != consistent_detail(k) or int(rec["load"]["num_used_tokens"]) != 3 * k
    print(json.dumps({"role": "detailed_reader", "reads": reads, "bad": bad}), flush=True)


def writer(board_name: str, rank: int, seconds: float) -> None:
    k = _publish_for(board_name, rank, seconds, 1000, lambda w, k: w.publish(consistent_snapshot(rank, k)))
    print(json.dumps({"role": "writer", "rank": rank, "publishes": k}), flush=True)


def paced_writer(board_name: str, rank: int, period: float, seconds: float) -> None:
    """Publishes once every ``period`` seconds for ``seconds`` (a scheduler's pace, not a stress)."""
    board = Board.attach(board_name)
    w = board.writer(rank)
    deadline = time.monotonic() + seconds
    k = 0
    while time.monotonic() < deadline:
        k += 1
        w.publish(consistent_snapshot(rank, k))
        time.sleep(period)
    print(json.dumps({"role": "paced_writer", "rank": rank, "publishes": k}), flush=True)


def reader(board_name: str, seconds: float) -> None:
    board = Board.attach(board_name)
    r = board.reader()
    deadline = time.monotonic() + seconds
    reads = bad = torn = 0
    last_seq: dict[int, int] = {}
    went_backwards = 0
    while time.monotonic() < deadline:
        for snap in r.read_all():
            if snap is None:
                continue
            reads += 1
            if not check_snapshot(snap):
                bad += 1
            if snap.publish_seq < last_seq.get(snap.dp_rank, 0):
                went_backwards += 1
            last_seq[snap.dp_rank] = snap.publish_seq
        arr = r.read_array()
        for rec in arr[arr["status"] == 1]:
            reads += 1
            snap = LoadSnapshot(*(int(rec[f]) for f in LoadSnapshot._fields))
            if not check_snapshot(snap):
                bad += 1
        torn += int((arr["status"] == 3).sum())
    print(json.dumps({"role": "reader", "reads": reads, "bad": bad, "torn": torn,
                      "went_backwards": went_backwards}), flush=True)


def paused_writer(board_name: str, rank: int) -> None:
    """Publishes once, then starts a second publish that pauses between its sequence stores."""
    board = Board.attach(board_name)
    w = board.writer(rank)
    w.publish(consistent_snapshot(rank, 1))
    print(json.dumps({"role": "paused_writer", "pid": os.getpid()}), flush=True)
    w._publish_paused(consistent_snapshot(rank, 2), 60.0)


def hold_writer(board_name: str, rank: int) -> None:
    """Takes the writer of a slot and keeps it until stdin closes."""
    board = Board.attach(board_name)
    w = board.writer(rank)
    w.publish(consistent_snapshot(rank, 1))
    print(json.dumps({"role": "hold_writer", "pid": os.getpid()}), flush=True)
    sys.stdin.read()


def create_and_vanish(board_name: str, n_slots: int) -> None:
    """Creates a board and dies without cleaning up, as a crashed creator would."""
    Board.create(board_name, n_slots=n_slots)
    print(json.dumps({"role": "create_and_vanish", "pid": os.getpid()}), flush=True)
    os._exit(0)


def attach_wait(board_name: str, timeout: float) -> None:
    """Says it started, then attaches with ``timeout`` (a board still being created is waited for)."""
    print(json.dumps({"role": "attach_wait", "started": True}), flush=True)
    try:
        board = Board.attach(board_name, timeout=timeout)
    except Exception as e:
        print(json.dumps({"role": "attach_wait", "error": type(e).__name__, "message": str(e)}), flush=True)
        return
    print(json.dumps({"role": "attach_wait", "error": None, "n_slots": board.n_slots}), flush=True)


def attach(board_name: str) -> None:
    try:
        Board.attach(board_name)
    except PermissionError as e:
        print(json.dumps({"role": "attach", "error": "PermissionError", "message": str(e)}), flush=True)
        return
    print(json.dumps({"role": "attach", "error": None}), flush=True)


if __name__ == "__main__":
    role, name, *rest = sys.argv[1:]
    if role == "writer":
        writer(name, int(rest[0]), float(rest[1]))
    elif role == "paced_writer":
        paced_writer(name, int(rest[0]), float(rest[1]), float(rest[2]))
    elif role == "reader":
        reader(name, float(rest[0]))
    elif role == "detailed_writer":
        detailed_writer(name, int(rest[0]), float(rest[1]))
    elif role == "detailed_reader":
        detailed_reader(name, float(rest[0]))
    elif role == "paused_writer":
        paused_writer(name, int(rest[0]))
    elif role == "hold_writer":
        hold_writer(name, int(rest[0]))
    elif role == "create_and_vanish":
        create_and_vanish(name, int(rest[0]))
    elif role == "attach":
        attach(name)
    elif role == "attach_wait":
        attach_wait(name, float(rest[0]))
    else:
        raise SystemExit(f"unknown role {role!r}")
