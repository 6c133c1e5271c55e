"""``dpboard bench TOPIC``: each topic's figures beside its baseline, measured in one run."""

from __future__ import annotations

import argparse
import importlib

TOPICS = {
    "board": "publish and read latency of the board vs an msgpack+flock board",
    "kernels": "loads from KV page tables: every backend vs the NumPy reference",
    "dispatch": "one dispatch decision and batches vs a pure-Python budget",
    "relay": "write-to-visible latency through relay and collector",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topic", choices=[*TOPICS, "all"], help="; ".join(f"{k}: {v}" for k, v in TOPICS.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options for the topic (e.g. --quick)")


def run(args: argparse.Namespace) -> int:
    topics = list(TOPICS) if args.topic == "all" else [args.topic]
    status = 0
    for topic in topics:
        module = importlib.import_module(f"dpboard.bench.{topic}")
        status |= module.main(list(args.rest))
        print()
    return status
