"""``dpboard bench relay``: write on a node -> visible in node0's board, through relays and the collector.

N "nodes" run on this machine, each as two processes: one writes R ranks into its own local board at
a fixed rate (the schedulers), one runs the relay toward node0 over TCP loopback. node0's collector
runs in this process and takes, for every snapshot it publishes, CLOCK_REALTIME now minus the
snapshot's ``timestamp_ns`` (the writer's CLOCK_REALTIME at the write; one machine, one clock).

That latency counts only the snapshots that travel (each rank's latest per tick), so it flatters: a
controller reads node0's board at any moment, when its copy of a rank may be up to a tick older. A
sampler process therefore reads node0's board at random instants (Poisson) and takes the age of
every rank's copy there, beside the age of the same rank on its own local board at the same
instant (what a reader on that node would see: the publish period alone). The first is what the
controller actually gets; the difference is the relay's share.

With ``--detail`` the relay path runs a second time with every publish carrying an engine's whole
snapshot (the SGLang plugin's case), so that frames hold 456-byte records instead of 104. The writers
then publish a ``LoadSnapshot`` object in every run, with the detail or without it, so that the
runs differ only in what the relay carries.

The baseline, measured in the same run with the same writers: no relay and no batching, every
publish also sent at once as its own msgpack message on a PUSH socket (the straightforward design),
received by a PULL loop here that writes each into node0's board.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from dpboard.bench.stats import add_common_arguments, describe, write_json
from dpboard.board import Board
from dpboard.multinode.relay import DEFAULT_TICK_MS
from dpboard.options import count, milliseconds, positive, seconds
from dpboard.processes import module_command
from dpboard.snapshot import (
    DisaggregationDetail,
    LoadDetail,
    LoadSnapshot,
    LoraDetail,
    MemoryDetail,
    QueueDetail,
    SlotStatus,
    SpeculativeDetail,
    pack_detail,
)
from dpboard.stopping import SignalRelay

SNAPSHOT_FIELDS = 13
# What an SGLang scheduler reports beside the dispatch fields, every section present.
BENCH_DETAIL = LoadDetail(
    timestamp=1.0, num_waiting_uncached_tokens=4096, max_running_requests=256, token_usage=0.5,
    gen_throughput=1500.0, cache_hit_rate=0.25, utilization=0.75, decode_moments=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0),
    memory=MemoryDetail(14.0, 60.0, 1.5, 200_000), speculative=SpeculativeDetail(2.5, 0.8),
    lora=LoraDetail(1, 8, 0.125), disaggregation=DisaggregationDetail("decode", 1, 2, 3, 4, 5, 10.0, 0.5),
    queues=QueueDetail(3, 0, 0, 0, 1),
)


def _percentiles(lat_ns: np.ndarray) -> dict[str, float]:
    if lat_ns.size == 0:
        return {"p50": float("nan"), "p99": float("nan"), "p99.9": float("nan")}
    us = lat_ns / 1e3
    return {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
            "p99.9": float(np.percentile(us, 99.9))}


# -- the processes of one "node" ------------------------------------------------------------------------


def _writer_main(args: argparse.Namespace) -> int:
    """Publish every rank of node ``args.node`` at ``args.rate`` Hz into its local board; with
    ``--naive ENDPOINT`` also push each snapshot as its own msgpack message."""
    import msgpack

    stop = threading.Event()
    SignalRelay({signal.SIGTERM: stop}).__enter__()  # for the process's life; no lock in the handler
    board = Board.create(args.local_board, n_slots=args.n_slots, node_id=args.node)
    first = (args.node - 1) * args.ranks
    writers = [board.writer(r) for r in range(first, first + args.ranks)]
    push = None
    if args.naive:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1000)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.IMMEDIATE, 1)
        push.connect(args.naive)
    print("ready", flush=True)
    period = 1.0 / args.rate
    published = dropped = 0
    started = next_at = time.monotonic()
    reader = board.reader() if push is not None else None
    # --publish: "values" is the cheapest call; "snapshot" and "detailed" are what an engine plugin
    # makes (a LoadSnapshot, and with "detailed" its whole snapshot beside it: every SGLang section)
    detail = pack_detail(BENCH_DETAIL) if args.publish == "detailed" else None
    while not stop.is_set():
        if args.publish == "values":
            for w in writers:
                w.publish_values(published % 64, 1, published % 100000, published % 100000, published % 100000,
                                 100000, published)
        else:
            for rank, w in enumerate(writers, first):
                w.publish(LoadSnapshot(rank, published % 64, 1, published % 100000, published % 100000,
                                       published % 100000, 100000, published), detail)
        published += 1
        if push is not None:
            for snap in reader.read_all()[first:first + args.ranks]:
                try:
                    push.send(msgpack.packb(tuple(snap)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    dropped += 1
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        elif delay < -10 * period:
            next_at = time.monotonic()  # far behind: do not burst to catch up
    rate = published * len(writers) / max(time.monotonic() - started, 1e-9)
    print(json.dumps({"published_s": rate, "dropped": dropped}), flush=True)
    if push is not None:
        push.close(0)
    board.close()
    board.unlink()
    return 0


def _sampler_main(args: argparse.Namespace) -> int:
    """After ``--warmup`` seconds, for ``--duration`` seconds: at random instants (exponential gaps,
    mean ``--sample-ms``) the age (CLOCK_REALTIME now minus the snapshot's timestamp_ns) of every
    rank's snapshot on node0's board and on the rank's own local board. Prints both as JSON."""
    board0 = Board.attach(args.board0)
    locals_ = [Board.attach(name) for name in args.local_boards.split(",")]
    reader0 = board0.reader(stale_after=3600)
    local_readers = [b.reader(stale_after=3600) for b in locals_]
    ranks_of = [np.arange((k - 1) * args.ranks, k * args.ranks) for k in range(1, len(locals_) + 1)]
    with_data = (int(SlotStatus.LIVE), int(SlotStatus.STALE))
    rng = np.random.default_rng(7)
    print("ready", flush=True)
    time.sleep(args.warmup)
    end = time.monotonic() + args.duration
    node0_ages: list[np.ndarray] = []
    local_ages: list[np.ndarray] = []
    instants = 0
    while True:
        gap = rng.exponential(args.sample_ms / 1e3)
        if time.monotonic() + gap >= end:
            break
        time.sleep(gap)
        arr0 = reader0.read_array()
        now = time.time_ns()
        ok = np.isin(arr0["status"], with_data)
        node0_ages.append(now - arr0["timestamp_ns"][ok])
        for reader, ranks in zip(local_readers, ranks_of, strict=True):
            arr = reader.read_array()
            now = time.time_ns()
            sel = arr[ranks]
            local_ages.append(now - sel["timestamp_ns"][np.isin(sel["status"], with_data)])
        instants += 1
    out = {"instants": instants,
           "node0": _percentiles(np.concatenate(node0_ages) if node0_ages else np.zeros(0)),
           "local": _percentiles(np.concatenate(local_ages) if local_ages else np.zeros(0))}
    print(json.dumps(out), flush=True)
    return 0


def _start_sampler(args: argparse.Namespace, board0: str, tag: str) -> subprocess.Popen:
    local_boards = ",".join(f"{tag}-n{k}" for k in range(1, args.nodes + 1))
    proc = _spawn(["--_sampler", "--board0", board0, "--local-boards", local_boards, "--ranks", str(args.ranks),
                   "--warmup", str(args.warmup), "--duration", str(args.duration), "--sample-ms",
                   str(args.sample_ms)])
    return proc


def _sampler_result(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    try:
        return json.loads(_line(proc, timeout) or "{}")
    except (RuntimeError, json.JSONDecodeError):
        return {}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _relay_main(args: argparse.Namespace) -> int:
    from dpboard.multinode.relay import Relay

    stop = threading.Event()
    SignalRelay({signal.SIGTERM: stop}).__enter__()  # for the process's life; no lock in the handler
    with Relay(args.local_board, args.to, args.node, tick_ms=args.tick_ms, remote_board=args.board0) as relay:
        print("ready", flush=True)
        relay.run(stop)
        print(json.dumps(relay.stats()), flush=True)
    return 0


# -- the driver ----------------------------------------------------------------------------------------


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(module_command("dpboard.bench.relay", *argv), stdout=subprocess.PIPE,
                            text=True)


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"bench process {proc.args[3:]} said nothing within {timeout} s")
    return proc.stdout.readline().strip()


def _stop_all(procs: list[subprocess.Popen]) -> list[dict[str, Any]]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    results = []
    for p in procs:
        try:
            results.append(json.loads(_line(p, 10) or "{}"))
        except (RuntimeError, json.JSONDecodeError):
            results.append({})
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return results


def _node_args(args: argparse.Namespace, tag: str, node: int, n_slots: int, detail: bool = False) -> list[str]:
    publish = "detailed" if detail else "snapshot" if args.detail else "values"
    return ["--node", str(node), "--local-board", f"{tag}-n{node}", "--n-slots", str(n_slots),
            "--ranks", str(args.ranks), "--rate", str(args.rate), "--publish", publish]


def _measure_relay(args: argparse.Namespace, tag: str, *, detail: bool = False) -> dict[str, Any]:
    from dpboard.multinode.collector import Collector

    n_slots = args.nodes * args.ranks
    tag = f"{tag}-d" if detail else tag
    name0 = f"{tag}-r0"
    procs: list[subprocess.Popen] = []
    with Board.create(name0, n_slots=n_slots) as board0, \
            Collector(board0, "tcp://127.0.0.1:*", record_latency=True) as collector:
        try:
            # each process joins procs as soon as it exists, so that a failed start stops the others
            for k in range(1, args.nodes + 1):
                procs.append(_spawn(["--_writer", *_node_args(args, tag, k, n_slots, detail)]))
            for p in procs:
                _line(p, 30)
            for k in range(1, args.nodes + 1):
                procs.append(_spawn(["--_relay", "--node", str(k), "--local-board", f"{tag}-n{k}", "--to",
                                     collector.endpoint, "--board0", name0, "--tick-ms", str(args.tick_ms)]))
            for p in procs[args.nodes :]:
                _line(p, 30)
            sampler = _start_sampler(args, name0, tag)
            procs.append(sampler)
            _line(sampler, 30)
            collector.serve(duration=args.warmup, poll_ms=10)
            collector.latencies_ns.clear()
            before = collector.stats()
            started = time.monotonic()
            collector.serve(duration=args.duration, poll_ms=10)
            elapsed = time.monotonic() - started
            after = collector.stats()
            lat = np.concatenate(collector.latencies_ns) if collector.latencies_ns else np.zeros(0)
            procs.remove(sampler)
            sampled = _sampler_result(sampler, 30)
        finally:
            results = _stop_all(procs)
    writer_stats, relay_stats = results[: args.nodes], results[args.nodes : 2 * args.nodes]
    return {
        "sampled": sampled,
        **_percentiles(lat),
        "frames_s": (after["frames_ok"] - before["frames_ok"]) / elapsed,
        "snapshots_s": (after["snapshots_ok"] - before["snapshots_ok"]) / elapsed,
        "published_s": sum(w.get("published_s", 0) for w in writer_stats),
        "drops": sum(r.get("frames_dropped", 0) for r in relay_stats),
        "bad": after["frames_bad"],
        "samples": int(lat.size),
    }


def _measure_naive(args: argparse.Namespace, tag: str) -> dict[str, Any]:
    import msgpack

    n_slots = args.nodes * args.ranks
    name0 = f"{tag}-b0"
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    procs: list[subprocess.Popen] = []
    lat: list[int] = []
    received = 0
    with Board.create(name0, n_slots=n_slots) as board0:
        writers: dict[int, Any] = {}
        try:
            for k in range(1, args.nodes + 1):
                procs.append(_spawn(["--_writer", *_node_args(args, tag, k, n_slots), "--naive",
                                     f"tcp://127.0.0.1:{port}"]))
            for p in procs:
                _line(p, 30)
            sampler = _start_sampler(args, name0, tag)
            procs.append(sampler)
            _line(sampler, 30)
            measure_from = time.monotonic() + args.warmup
            end = measure_from + args.duration
            measuring = False
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if not measuring and now >= measure_from:
                    measuring, lat, received, started = True, [], 0, now
                if not pull.poll(10):
                    continue
                while True:
                    try:
                        raw = pull.recv(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    snap = tuple(msgpack.unpackb(raw))
                    rank = snap[0]
                    w = writers.get(rank) or writers.setdefault(rank, board0.writer(rank))
                    w.publish_relayed(snap)
                    lat.append(time.time_ns() - snap[8])
                    received += 1
            elapsed = time.monotonic() - started
            procs.remove(sampler)
            sampled = _sampler_result(sampler, 30)
        finally:
            results = _stop_all(procs)
            pull.close(0)
    arr = np.asarray(lat, dtype=np.int64)
    return {
        "sampled": sampled,
        **_percentiles(arr),
        "frames_s": received / elapsed,
        "snapshots_s": received / elapsed,
        "published_s": sum(w.get("published_s", 0) for w in results),
        "drops": sum(w.get("dropped", 0) for w in results),
        "bad": 0,
        "samples": int(arr.size),
    }


def _table(args: argparse.Namespace, relay: dict[str, Any], naive: dict[str, Any] | None,
           detailed: dict[str, Any] | None = None) -> str:
    rows = [("dpboard relay (batched frame per tick)", relay)]
    if detailed is not None:
        rows.append(("dpboard relay, every slot with a detail (456-byte records)", detailed))
    if naive is not None:
        rows.append(("baseline: one msgpack message per publish", naive))
    lines = [
        f"relay: {args.nodes} nodes x {args.ranks} ranks at {args.rate:g} Hz, tick {args.tick_ms:g} ms, "
        f"{args.duration:g} s measured after {args.warmup:g} s warm-up, TCP loopback, {os.cpu_count()} CPUs"
        + ("; writers publish LoadSnapshot objects, with or without a detail" if args.detail else ""),
        "",
        "| path | write->visible p50 (us) | p99 (us) | p99.9 (us) | frames/s | snapshots/s visible "
        "| snapshots/s written | drops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows:
        lines.append(f"| {label} | {r['p50']:.0f} | {r['p99']:.0f} | {r['p99.9']:.0f} | {r['frames_s']:.0f} "
                     f"| {r['snapshots_s']:.0f} | {r['published_s']:.0f} | {r['drops']} |")
    target = "met" if relay["p99"] <= 2000 else "NOT met"
    lines += ["", "write->visible: CLOCK_REALTIME when node0's board holds a snapshot minus the writer's "
              "timestamp_ns in it (every snapshot that becomes visible; the relay sends each rank's latest "
              "per tick, so overwritten ones never travel)",
              f"target p99 <= 2000 us: {target} ({relay['p99']:.0f} us over {relay['samples']} snapshots; "
              f"{relay['bad']} bad frames)", "",
              "What a reader sees: the age of each rank's snapshot at random instants (Poisson, mean "
              f"{args.sample_ms:g} ms), on node0's board and, at the same instants, on the rank's own local board",
              "",
              "| path | node0's copy p50 (us) | p99 (us) | p99.9 (us) | local board p50 (us) | p99 (us) | instants |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows:
        s = r.get("sampled") or {}
        n0, lo = s.get("node0", {}), s.get("local", {})
        lines.append(f"| {label} | {n0.get('p50', float('nan')):.0f} | {n0.get('p99', float('nan')):.0f} | "
                     f"{n0.get('p99.9', float('nan')):.0f} | {lo.get('p50', float('nan')):.0f} | "
                     f"{lo.get('p99', float('nan')):.0f} | {s.get('instants', 0)} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpboard bench relay", description=describe(__doc__))
    p.add_argument("--nodes", type=count(1, 64), default=8, help="relay nodes (default 8)")
    p.add_argument("--ranks", type=count(1, 4096), default=64, help="ranks per node (default 64)")
    p.add_argument("--rate", type=positive(1e5), default=1000.0, help="publishes per rank per second (default 1000)")
    p.add_argument("--tick-ms", type=milliseconds(1e4), default=DEFAULT_TICK_MS,
                   help=f"relay tick (default {DEFAULT_TICK_MS:g})")
    p.add_argument("--duration", type=seconds(3600), default=5.0, help="seconds measured (default 5)")
    p.add_argument("--warmup", type=seconds(3600, zero=True), default=1.0, help="seconds before measuring (default 1)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unbatched baseline")
    p.add_argument("--detail", action="store_true",
                   help="also run the relay with every slot holding a detail (an SGLang plugin's publish)")
    add_common_arguments(p, "2 nodes x 16 ranks, 2 s: a smoke run at 1/16 of the load, where the "
                            "unbatched baseline keeps up and wins on latency (docs/BENCHMARKS.md)")
    p.add_argument("--sample-ms", type=milliseconds(1e4), default=2.0,
                   help="mean gap between the random instants node0's board is sampled at (default 2)")
    # The processes of a node (internal).
    p.add_argument("--_writer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--publish", choices=("values", "snapshot", "detailed"), default="values", help=argparse.SUPPRESS)
    p.add_argument("--_relay", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_sampler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local-boards", help=argparse.SUPPRESS)
    p.add_argument("--node", type=count(1, 64), help=argparse.SUPPRESS)
    p.add_argument("--local-board", help=argparse.SUPPRESS)
    p.add_argument("--n-slots", type=count(1, 1 << 16), help=argparse.SUPPRESS)
    p.add_argument("--naive", help=argparse.SUPPRESS)
    p.add_argument("--to", help=argparse.SUPPRESS)
    p.add_argument("--board0", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args._writer:
        return _writer_main(args)
    if args._relay:
        return _relay_main(args)
    if args._sampler:
        return _sampler_main(args)
    if args.quick:
        args.nodes, args.ranks, args.duration, args.warmup = 2, 16, 2.0, 0.5
    if args.nodes < 1 or args.ranks < 1 or args.rate <= 0 or args.duration <= 0:
        raise ValueError("--nodes, --ranks, --rate and --duration must be positive")
    tag = f"bench-relay-{os.getpid()}"
    relay = _measure_relay(args, tag)
    detailed = _measure_relay(args, tag, detail=True) if args.detail else None
    naive = None if args.no_baseline else _measure_naive(args, tag)
    print(_table(args, relay, naive, detailed))
    if args.quick and naive is not None:
        print("\n--quick runs a sixteenth of the full load: there the unbatched baseline keeps up and is "
              "visible at once, while the relay holds each change until its next tick, so the baseline's "
              "p50 is lower. Compare designs on a full run (docs/BENCHMARKS.md, Relay).")
    write_json(args.json, {"quick": args.quick, "relay": relay, "detailed": detailed, "baseline": naive})
    return 0


if __name__ == "__main__":
    sys.exit(main())
