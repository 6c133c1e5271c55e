"""``dpboard ls | info | dump | clean``: read-only looks at boards, and removal of dead ones.

Imports only the board and reads it through the C reader's plain values: ``ls``, ``info``,
``clean`` (and ``dump``) load no NumPy, so they start in about the time the interpreter does
(docs/BENCHMARKS.md, "Start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from dpboard.board import DEFAULT_STALE_AFTER, Board, clean_boards, list_boards, segment_path, validate_name
from dpboard.board.listing import clean_sent_records
from dpboard.board.sent import sent_path
from dpboard.board.stale import stale_after
from dpboard.errors import NotFoundError
from dpboard.options import count
from dpboard.ownership import remove_abandoned_locks, user_name
from dpboard.views.rows import fmt_age, slot_rows, status_counts, status_of


def _stale_after(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--stale-after", type=stale_after, default=DEFAULT_STALE_AFTER,
                   help=f"seconds without a publish before {what} (default 1.0)")


def _trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-uid", type=count(0, 2**32 - 2), action="append", default=[], metavar="UID",
                   help="also read a board this user created (e.g. 0 for root); repeatable")


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _stale_after(p, "a board whose creator is gone counts as dead")


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="board name (without the dpboard. prefix)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _stale_after(p, "a slot is stale")
    _trust(p)


def add_dump_arguments(p: argparse.ArgumentParser) -> None:
    add_info_arguments(p)


def add_clean_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="only this board (default: every board that is not alive)")
    p.add_argument("--force", action="store_true", help="also remove a live board")
    _stale_after(p, "a board whose creator is gone counts as dead")


# -- commands -----------------------------------------------------------------------------------


def run_ls(args: argparse.Namespace) -> int:
    listings = list_boards(stale_after=args.stale_after)
    if args.json:
        out = []
        for entry in listings:
            item: dict[str, Any] = {"name": entry.name, "size": entry.size, "error": entry.error,
                                    "owner_uid": entry.owner_uid, "mode": entry.mode}
            if entry.header is not None:
                item.update(entry.header.as_dict())
                item["alive"] = entry.alive
                item["last_publish_age_s"] = entry.last_publish_age
            out.append(item)
        print(json.dumps(out, indent=2))
        return 0
    if not listings:
        print("no boards on this machine")
        return 0
    print(f"{'NAME':<24} {'SLOTS':>5} {'CREATOR':>10} {'ALIVE':<5} {'PUBLISHED':>9} {'OWNER':<10} {'CREATED (UTC)':<19}")
    for entry in listings:
        owner = "?" if entry.owner_uid is None else (user_name(entry.owner_uid) or str(entry.owner_uid))
        name = entry.name if _is_valid_name(entry.name) else repr(entry.name)  # never print a raw line break
        if entry.header is None:
            print(f"{name:<24} {'?':>5} {'?':>10} {'?':<5} {'?':>9} {owner:<10} {entry.error}")
            continue
        h = entry.header
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(h.creation_time_ns / 1e9))
        alive = "yes" if entry.alive else "no"
        published = "never" if entry.last_publish_age is None else fmt_age(entry.last_publish_age)
        damage = "" if entry.error is None else f" {entry.error}"
        print(f"{name:<24} {h.n_slots:>5} {h.creator_pid:>10} {alive:<5} {published:>9} {owner:<10} {created:<19}"
              f"{damage}")
    return 0


def _is_valid_name(name: str) -> bool:
    try:
        validate_name(name)
    except ValueError:
        return False
    return True


def run_info(args: argparse.Namespace) -> int:
    board = Board.attach(args.name, trust_uids=args.trust_uid)
    rows = slot_rows(board.reader(stale_after=args.stale_after, arrays=False))
    info = {
        "board": board.name,
        "segment": str(segment_path(board.name)),
        **board.header.as_dict(),
        "slots": status_counts(rows),
        "collector": board.collector_stats(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    h = board.header
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h.creation_time_ns / 1e9))
    print(f"board        {board.name}  ({info['segment']})")
    print(f"layout       version {h.layout_version}, {h.n_slots} slot{'s' if h.n_slots != 1 else ''} x {h.slot_size} B after {h.header_size} B")
    print(f"creator      pid {h.creator_pid} ({'alive' if h.creator_alive else 'dead'}), created {created}")
    print(f"generation   {h.generation:#018x}   node {h.node_id}")
    print("slots        " + ", ".join(f"{n} {label}" for label, n in info["slots"].items()))
    c = info["collector"]
    if c["collector_pid"]:
        state = "alive" if c["collector_alive"] else "dead"
        print(f"collector    pid {c['collector_pid']} ({state}): {c['frames_ok']} frames, "
              f"{c['snapshots_ok']} snapshots, {c['frames_bad']} bad frames dropped")
        bad = {k: v for k, v in c.items() if k.startswith("bad_") and v}
        if bad:
            print("             " + ", ".join(f"{k[4:]} {v}" for k, v in bad.items()))
    else:
        print("collector    none has run on this board")
    return 0


def run_dump(args: argparse.Namespace) -> int:
    board = Board.attach(args.name, trust_uids=args.trust_uid)
    rows = slot_rows(board.reader(stale_after=args.stale_after, arrays=False))
    if args.json:
        print(json.dumps({"board": board.name, "n_slots": board.n_slots, "slots": rows}, indent=2))
        return 0
    print(f"board {board.name}: {board.n_slots} slot{'s' if board.n_slots != 1 else ''}, " +
          ", ".join(f"{n} {label}" for label, n in status_counts(rows).items()))
    print(f"{'RANK':>4} {'STATUS':<6} {'RUN':>6} {'WAIT':>6} {'USED':>10} {'TOTAL':>10} {'ACTIVE':>10} "
          f"{'CAPACITY':>10} {'USAGE':>6} {'RECV':>8} {'AGE':>7} {'PID':>7} {'NODE':>4} {'SEQ':>8}")
    for row in rows:
        if not status_of(row).has_snapshot:
            print(f"{row['dp_rank']:>4} {row['status']:<6}")
            continue
        print(f"{row['dp_rank']:>4} {row['status']:<6} {row['num_running_reqs']:>6} {row['num_waiting_reqs']:>6} "
              f"{row['num_used_tokens']:>10} {row['num_total_tokens']:>10} {row['num_active_tokens']:>10} "
              f"{row['max_total_num_tokens']:>10} {row['token_usage']:>6.1%} {row['num_received_reqs']:>8} "
              f"{fmt_age(row['age_s']):>7} {row['writer_pid']:>7} {row['node_id']:>4} {row['publish_seq']:>8}")
    return 0


def run_clean(args: argparse.Namespace) -> int:
    try:
        removed = clean_boards(args.name, force=args.force, stale_after=args.stale_after)
    except NotFoundError:
        if args.name is None or not os.path.lexists(sent_path(args.name)):
            raise
        removed = []  # the board is gone, its sent record is not
    for name in removed:
        print(f"removed {segment_path(name)}")
    # then the sent records (vLLM's API servers) of boards that are gone, the ones just removed included
    records = clean_sent_records(args.name, force=args.force)
    for name in records:
        print(f"removed {sent_path(name)} (the sent record of board {name!r}, held by no live process)")
    # a whole clean also takes the lock files that owners killed with SIGKILL left behind
    locks = remove_abandoned_locks() if args.name is None else []
    for path in locks:
        print(f"removed {path} (a lock no live process holds)")
    if not removed and not records and not locks and args.name is None and not list_boards():
        print("nothing to remove: there are no boards on this machine")
    elif not removed and not records and not locks:
        print("nothing to remove: every board is alive (its creator runs, or a slot was published within "
              f"{args.stale_after:g} s) and every sent record has its board or a live sender; use --force to "
              "remove one anyway")
    return 0

