"""Small helpers shared by the benchmarks: per-call timing, percentiles, markdown tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence

import numpy as np

from dpboard.options import output_file


def timer_overhead_ns(n: int = 20000) -> float:
    """Median cost of one perf_counter_ns() pair, to read per-call figures against."""
    t = time.perf_counter_ns
    samples = np.empty(n, dtype=np.int64)
    for i in range(n):
        a = t()
        samples[i] = t() - a
    return float(np.median(samples))


def per_call_ns(fn: Callable[[], object], n: int) -> np.ndarray:
    """Times each of n calls separately (each figure includes one timer pair)."""
    t = time.perf_counter_ns
    samples = np.empty(n, dtype=np.int64)
    for i in range(n):
        a = t()
        fn()
        samples[i] = t() - a
    return samples


def batched_ns(fn: Callable[[], object], batches: int, batch: int) -> np.ndarray:
    """Mean per call over each batch of `batch` calls: no timer cost, tails smoothed."""
    t = time.perf_counter_ns
    samples = np.empty(batches, dtype=np.float64)
    rng = range(batch)
    for i in range(batches):
        a = t()
        for _ in rng:
            fn()
        samples[i] = (t() - a) / batch
    return samples


def pct(samples: np.ndarray, q: float) -> float:
    return float(np.percentile(samples, q))


def fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}")


def add_common_arguments(parser: argparse.ArgumentParser, quick: str) -> None:
    """The two options every topic takes, spelled the same everywhere: ``--quick`` (a smoke run, whose
    figures are not the ones to quote) and ``--json FILE`` (the figures as JSON, the path checked
    before the run)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", metavar="FILE", type=output_file,
                        help="also write the figures to FILE as JSON (its folder is checked before the run)")


def write_json(path: str | None, doc: object) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2, default=float)
            f.write("\n")


def describe(doc: str | None) -> str:
    """A topic's --help description: its docstring's first paragraph, whole, in plain text."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.split()).replace("``", "")


def topic_parser(topic: str, doc: str | None, quick: str) -> argparse.ArgumentParser:
    """A topic's parser, before its own options: ``dpboard bench TOPIC``, its docstring's first
    paragraph as the description, and the options every topic takes (``quick``: what --quick does)."""
    parser = argparse.ArgumentParser(prog=f"dpboard bench {topic}", description=describe(doc))
    add_common_arguments(parser, quick)
    return parser
