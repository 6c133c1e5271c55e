"""Processes that the board tests start: real writers and readers in their own interpreters.

Run as ``python tests/board_procs.py ROLE BOARD ...``; each role prints one JSON line when done.
"""

from __future__ import annotations

import json
import os
import sys
import time

from dpboard import Board, LoadSnapshot


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


def writer(board_name: str, rank: int, seconds: float) -> None:
    board = Board.attach(board_name)
    w = board.writer(rank)
    deadline = time.monotonic() + seconds
    k = 0
    while time.monotonic() < deadline:
        for _ in range(1000):
            k += 1
            w.publish(consistent_snapshot(rank, k))
    print(json.dumps({"role": "writer", "rank": rank, "publishes": k}), flush=True)


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
    elif role == "reader":
        reader(name, float(rest[0]))
    elif role == "paused_writer":
        paused_writer(name, int(rest[0]))
    elif role == "hold_writer":
        hold_writer(name, int(rest[0]))
    elif role == "create_and_vanish":
        create_and_vanish(name, int(rest[0]))
    elif role == "attach":
        attach(name)
    else:
        raise SystemExit(f"unknown role {role!r}")
