"""``dpboard bench board``: publish and read latency of the board, beside SGLang's own.

Measured in one run, on the same machine, for both implementations:
- publish: one snapshot into one slot (per call, and mean over batches of 100 calls);
- the writer's p50/p99/p99.9 alone, and while another process reads the board in a tight loop;
- ``read_array()`` and ``read_all()`` of 8 and 64 slots while another process publishes into every slot
  (the baseline has only ``read_all``);
- with SGLang installed, the plugin's own paths: its writer (SGLang's ``LoadSnapshot`` into a slot,
  detail included) and its ``read_all`` (every slot back as SGLang's ``LoadSnapshot``).
The baseline is SGLang's real ``ShmLoadSnapshotWriter`` / ``ShmLoadSnapshotReader`` when SGLang is
installed, else the stand-in of dpboard.bench.sglang_board, labelled as such.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.bench.sglang_board import FlockBoard, FlockReader, FlockWriter, load_sglang, sglang_snapshot
from dpboard.bench.stats import (
    batched_ns,
    fmt_ns,
    machine_line,
    markdown_table,
    pct,
    per_call_ns,
    timer_overhead_ns,
    topic_parser,
    write_json,
)
from dpboard.board import Board
from dpboard.processes import module_command
from dpboard.snapshot import SLOT_SIZE, LoadSnapshot

HELPER_MAX_SECONDS = 300.0


def _snap(rank: int, k: int) -> LoadSnapshot:
    return LoadSnapshot(rank, k % 50, k % 7, 1000 + k % 4096, 2000 + k % 4096, 1900 + k % 4096, 1 << 20, k)


class _Impl:
    """Opens one implementation's board, writers and readers by name.

    ``kind``: ``dpboard``; ``sglang`` (SGLang's real writer and reader); ``flock`` (the stand-in).
    Where SGLang is installed, dpboard's slots carry a detail (as under the plugin) and SGLang's
    writer publishes SGLang's own snapshot."""

    def __init__(self, kind: str, target: str, n_slots: int, *, create: bool):
        self.kind = kind
        self.sglang, _ = load_sglang()
        if kind == "dpboard":
            self.board: Any = Board.create(target, n_slots) if create else Board.attach(target)
        elif kind == "sglang":
            self.board = target  # SGLang's writers create the file
        else:
            self.board = FlockBoard(target, n_slots, create=create)
        self.n_slots = n_slots
        self._sglang_writers: list[Any] = []

    def publisher(self, rank: int, k: int, *, detailed: bool = False) -> Callable[[], None]:
        """A call that publishes one snapshot of ``rank`` into its slot (``detailed``: dpboard writes a
        detail too, where SGLang is installed, as the SGLang plugin does)."""
        if self.kind == "dpboard":
            w = self.board.writer(rank, takeover=True)
            snap = _snap(rank, k)
            if self.sglang is None or not detailed:
                return lambda: w.publish(snap)
            from dpboard.integrations.sglang import convert

            detail = bytearray(convert.DETAIL_STRUCT.size)
            convert.pack(sglang_snapshot(self.sglang, rank, k), detail)
            return lambda: w.publish(snap, detail)
        if self.kind == "sglang":
            w = self.sglang.ShmLoadSnapshotWriter(self.board, self.n_slots, rank)
            self._sglang_writers.append(w)
            snap = sglang_snapshot(self.sglang, rank, k)
            return lambda: w.write(snap)
        flock_writer = FlockWriter(self.board, rank)
        snap = _snap(rank, k)
        return lambda: flock_writer.publish(snap)

    def reader(self) -> Any:
        if self.kind == "dpboard":
            return self.board.reader()
        if self.kind == "sglang":
            return self.sglang.ShmLoadSnapshotReader(self.board, self.n_slots)
        return FlockReader(self.board)

    def close(self) -> None:
        if self.kind == "dpboard":
            self.board.close()
            if self.board.is_owner:
                self.board.unlink()
        elif self.kind == "flock":
            self.board.close()
        for w in self._sglang_writers:
            w.close()


# -- the helper process: publishes into every slot, or reads in a tight loop ----------------------


def _helper(role: str, kind: str, target: str, n_slots: int) -> None:
    impl = _Impl(kind, target, n_slots, create=False)
    deadline = time.monotonic() + HELPER_MAX_SECONDS
    print("ready", flush=True)
    # Runs until the parent closes our stdin (it never writes, so readable means closed) or the deadline.
    stdin = sys.stdin.fileno()

    def keep_going() -> bool:
        return time.monotonic() < deadline and not select.select([stdin], [], [], 0)[0]

    count = 0
    if role == "publisher":
        pubs = [impl.publisher(r, r, detailed=True) for r in range(n_slots)]
        while keep_going():
            for _ in range(10):
                for pub in pubs:
                    pub()
            count += 10 * n_slots
    else:
        r = impl.reader()
        read = r.read_all
        while keep_going():
            for _ in range(100):
                read()
            count += 100
    print(json.dumps({"role": role, "count": count}), flush=True)


class _Helper:
    def __init__(self, role: str, kind: str, target: str, n_slots: int):
        self.proc = subprocess.Popen(
            module_command("dpboard.bench.board", "--helper", role, kind, target, str(n_slots)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"bench helper {role} for {kind} failed to start (said {line!r})")

    def stop(self) -> int:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            out = self.proc.stdout.read()
            return json.loads(out.strip().splitlines()[-1])["count"] if out.strip() else 0
        finally:
            self.proc.kill()
            self.proc.wait(timeout=10)


# -- measurements ---------------------------------------------------------------------------------


def _measure(kind: str, quick: bool) -> dict[str, Any]:
    scale = 10 if quick else 1
    n_pub = 200_000 // scale
    results: dict[str, Any] = {}
    tag = f"{os.getpid()}-{kind}"
    targets = {n: (f"bench-{tag}-{n}" if kind == "dpboard" else f"/dev/shm/sglang-baseline-{tag}-{n}")
               for n in (8, 64)}
    impls = {n: _Impl(kind, targets[n], n, create=True) for n in (8, 64)}
    try:
        impl = impls[64]
        publish = impl.publisher(0, 1)
        for n in (8, 64):  # every slot written once (SGLang's writer makes its file when it starts)
            for r in range(1, n):
                impls[n].publisher(r, r, detailed=True)()
        for _ in range(2000):
            publish()
        results["publish_batched"] = batched_ns(publish, n_pub // 100, 100)
        results["publish_alone"] = per_call_ns(publish, n_pub)
        hammer = _Helper("reader", kind, targets[64], 64)
        try:
            results["publish_hot_reader"] = per_call_ns(publish, n_pub)
        finally:
            results["hammer_reads"] = hammer.stop()
        if kind == "dpboard" and impl.sglang is not None:
            from dpboard.integrations.sglang.transport import BoardLoadReader, BoardLoadWriter

            results["publish_detailed"] = per_call_ns(impl.publisher(0, 1, detailed=True), n_pub)
            writer = BoardLoadWriter(impl.board, 64, 0)
            snap = sglang_snapshot(impl.sglang, 0, 1)
            results["plugin_write"] = per_call_ns(lambda: writer.write(snap), n_pub)
            plugin_reader = BoardLoadReader(impl.board, 64, stale_after=60.0)
            # every slot rewritten between two reads: each read decodes all 64 (only the read timed)
            writers = [writer] + [BoardLoadWriter(impl.board, 64, r) for r in range(1, 64)]
            snaps = [sglang_snapshot(impl.sglang, r, 1) for r in range(64)]
            changed = np.empty(max(200, n_pub // 200), dtype=np.int64)
            for i in range(len(changed)):
                for w, sn in zip(writers, snaps, strict=True):
                    w.write(sn)
                start = time.perf_counter_ns()
                plugin_reader.read_all()
                changed[i] = time.perf_counter_ns() - start
            results["plugin_read_all_64_changed"] = changed
            results["plugin_read_all_64_unchanged"] = per_call_ns(plugin_reader.read_all, len(changed))
        for n in (8, 64):
            r = impls[n].reader()
            pub = _Helper("publisher", kind, targets[n], n)
            try:
                time.sleep(0.05)
                n_reads = (50_000 if kind == "dpboard" else 5_000) // scale
                if kind == "dpboard":
                    results[f"read_array_{n}"] = per_call_ns(r.read_array, n_reads)
                    if n == 64 and impl.sglang is not None:
                        results["plugin_read_all_64"] = per_call_ns(plugin_reader.read_all, n_reads // 5)
                results[f"read_all_{n}"] = per_call_ns(r.read_all, n_reads)
            finally:
                results[f"publisher_writes_{n}"] = pub.stop()
    finally:
        for impl in impls.values():
            impl.close()
        for target in targets.values():
            if kind != "dpboard" and os.path.exists(target):
                os.unlink(target)
    return results


def report(quick: bool = False) -> tuple[str, dict[str, Any]]:
    timer = timer_overhead_ns()
    sglang, what = load_sglang()
    base_kind = "sglang" if sglang is not None else "flock"
    ours = _measure("dpboard", quick)
    base = _measure(base_kind, quick)

    def row(label: str, key: str, base_key: str | None, target: str) -> list[str]:
        o = ours[key]
        cells = [label, fmt_ns(pct(o, 50)), fmt_ns(pct(o, 99)), fmt_ns(pct(o, 99.9))]
        if base_key is None:
            return cells + ["-", "-", "-", "-", target]
        b = base[base_key]
        speedup = pct(b, 50) / pct(o, 50)
        return cells + [fmt_ns(pct(b, 50)), fmt_ns(pct(b, 99)), fmt_ns(pct(b, 99.9)), f"{speedup:.1f}x", target]

    rows = [
        row("publish, mean of 100-call batches", "publish_batched", "publish_batched", "≤ 0.4 µs, ≥ 10x"),
        row("publish, per call, no reader", "publish_alone", "publish_alone", "-"),
        row("publish, per call, hot reader", "publish_hot_reader", "publish_hot_reader",
            "p99.9 within 2x of no-reader"),
        row("read_array(), 8 slots, live publisher", "read_array_8", "read_all_8", "-"),
        row("read_array(), 64 slots, live publisher", "read_array_64", "read_all_64", "≤ 4 µs, ≥ 10x"),
        row("read_all(), 8 slots, live publisher", "read_all_8", "read_all_8", "-"),
        row("read_all(), 64 slots, live publisher", "read_all_64", "read_all_64", "≥ 4x"),
    ]
    if "plugin_write" in ours:
        rows += [
            row("publish with a detail, per call, no reader", "publish_detailed", "publish_alone", "-"),
            row("plugin write: SGLang LoadSnapshot into a slot", "plugin_write", "publish_alone", "-"),
            row("plugin read_all(), 64 slots -> SGLang LoadSnapshots, live publisher", "plugin_read_all_64",
                "read_all_64", "-"),
            row("plugin read_all(), 64 slots, every slot rewritten since the last read", "plugin_read_all_64_changed",
                "read_all_64", "-"),
            row("plugin read_all(), 64 slots, none rewritten since the last read", "plugin_read_all_64_unchanged",
                "read_all_64", "-"),
        ]
    headers = ["measurement", "dpboard p50", "p99", "p99.9", "baseline p50", "p99", "p99.9",
               "speedup (p50)", "target"]
    ratio_ours = pct(ours["publish_hot_reader"], 99.9) / pct(ours["publish_alone"], 99.9)
    ratio_base = pct(base["publish_hot_reader"], 99.9) / pct(base["publish_alone"], 99.9)
    if sglang is not None:
        baseline = (f"baseline: {what} (msgpack in {sglang.SLOT_SIZE // 1024} KiB slots under a whole-file "
                    f"flock), publishing SGLang's LoadSnapshot with its memory and queue sections")
        detail = "; dpboard's publisher writes the detail too, as under the SGLang plugin"
    else:
        baseline = (f"baseline: a stand-in written from SGLang 0.5.23's format (msgpack in 16 KiB slots under a "
                    f"whole-file flock; dpboard/bench/sglang_board.py), because {what}")
        detail = ""
    text = "\n".join([
        f"Board benchmark — {machine_line()}",
        baseline,
        f"slot: dpboard {SLOT_SIZE} B (read_array copies its first 112 B){detail}; per-call figures include "
        f"one timer pair ({timer:.0f} ns here)",
        "",
        markdown_table(headers, rows),
        "",
        f"writer p99.9 with a hot reader / without: dpboard {ratio_ours:.2f}x, baseline {ratio_base:.2f}x "
        f"(hot reader: a second process calling read_all() in a tight loop on the writer's board)",
    ])
    summary = {
        "machine": machine_line(),
        "baseline": what if sglang is not None else f"stand-in ({what})",
        "slot_size": SLOT_SIZE,
        "timer_overhead_ns": timer,
        "dpboard": {k: {"p50": pct(v, 50), "p99": pct(v, 99), "p99.9": pct(v, 99.9)}
                    for k, v in ours.items() if hasattr(v, "__len__")},
        "baseline_figures": {k: {"p50": pct(v, 50), "p99": pct(v, 99), "p99.9": pct(v, 99.9)}
                             for k, v in base.items() if hasattr(v, "__len__")},
        "writer_p999_hot_over_alone": {"dpboard": ratio_ours, "baseline": ratio_base},
    }
    return text, summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--helper"]:
        _helper(argv[1], argv[2], argv[3], int(argv[4]))
        return 0
    parser = topic_parser("board", __doc__, "a tenth of the samples")
    args = parser.parse_args(argv)
    text, summary = report(args.quick)
    print(text)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
