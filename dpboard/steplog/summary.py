"""``dpboard steps FILE_OR_DIR``: what a step log says, summed up.

Steps by mode (extend, decode, mixed, idle, other); the median and 90th percentile of the step time
by mode and by batch-size bucket (1, 2-3, 4-7, ... requests); the time per prefill token over the
extend steps and per decode request over the decode steps (their sums divided, and the median of
the per-step ratios); each file's rank, settings and what it lost (steps past the size cap, steps
the ring dropped, faults). A directory is read whole: every ``steps-*.bin`` in it, one per rank and
process, summed together. ``--json`` prints the same as one JSON document.

The step time is ``reader.step_times``: where steps overlap (SGLang's overlap scheduler, vLLM's
batch queue), each stretch of time counts for one step only, and a batch's launch (``launch_ns``; on a
CPU its whole forward) counts for its own step. Logs of format versions 1 and 2 are read alike.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpboard.steplog import format as fmt
from dpboard.steplog.reader import StepLogFile, read_step_log, step_log_paths, step_times


def batch_bucket(size: int) -> tuple[int, int]:
    """The batch-size bucket of ``size``: [0, 0], [1, 1], [2, 3], [4, 7], ... (powers of two)."""
    if size <= 1:
        return (max(size, 0), max(size, 0))
    lo = 1 << (int(size).bit_length() - 1)
    return (lo, 2 * lo - 1)


def _bucket_label(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _quantiles_ms(ns: np.ndarray) -> dict[str, float]:
    if not len(ns):
        return {"p50_ms": 0.0, "p90_ms": 0.0}
    return {"p50_ms": float(np.percentile(ns, 50)) / 1e6, "p90_ms": float(np.percentile(ns, 90)) / 1e6}


def _per_unit(times: np.ndarray, units: np.ndarray) -> dict[str, float | int]:
    """Σ time / Σ units and the median of time / units over the steps with units, µs."""
    has = units > 0
    if not has.any():
        return {"steps": 0, "units": 0, "mean_us": 0.0, "p50_us": 0.0}
    t, u = times[has].astype(np.float64), units[has].astype(np.float64)
    return {"steps": int(has.sum()), "units": int(u.sum()), "mean_us": float(t.sum() / u.sum() / 1e3),
            "p50_us": float(np.median(t / u) / 1e3)}


def summarize(logs: Sequence[StepLogFile]) -> dict[str, Any]:
    """The summary of ``logs`` together (one rank each, usually), as plain values."""
    files = []
    parts, times = [], []
    for log in logs:
        t = step_times(log.records)
        parts.append(log.records)
        times.append(t)
        files.append({"path": str(log.path), "engine": log.header.get("engine"),
                      "engine_version": log.header.get("engine_version"), "rank": log.header.get("rank"),
                      "pid": log.header.get("pid"), "closed": log.closed, "steps": int(len(log.records)),
                      "counts": {k: v for k, v in log.counts.items() if k != "flush_unix_ns"},
                      "partial_bytes": log.partial_bytes, "settings": log.settings})
    records = np.concatenate(parts) if parts else np.empty(0, dtype=fmt.record_dtype())
    t = np.concatenate(times) if times else np.empty(0, dtype=np.int64)
    total = len(records)
    modes: dict[str, Any] = {}
    for code, name in fmt.MODES.items():
        sel = records["mode"] == code
        n = int(sel.sum())
        if n:
            modes[name] = {"steps": n, "share": n / total, "time_s": float(t[sel].sum()) / 1e9,
                           "mean_batch": float(records["batch_size"][sel].mean()), **_quantiles_ms(t[sel])}
    buckets = []
    for code, name in fmt.MODES.items():
        sel = records["mode"] == code
        if not sel.any():
            continue
        sizes = records["batch_size"][sel]
        keys = sorted({batch_bucket(int(s)) for s in np.unique(sizes)})
        for lo, hi in keys:
            inside = sel & (records["batch_size"] >= lo) & (records["batch_size"] <= hi)
            buckets.append({"mode": name, "batch": _bucket_label(lo, hi), "batch_lo": lo, "batch_hi": hi,
                            "steps": int(inside.sum()), **_quantiles_ms(t[inside])})
    extend = records["mode"] == fmt.EXTEND
    decode = records["mode"] == fmt.DECODE
    per_token = _per_unit(t[extend], records["prefill_tokens"][extend].astype(np.int64))
    per_request = _per_unit(t[decode], records["decode_reqs"][decode].astype(np.int64))
    reqs = records["decode_reqs"][decode].astype(np.int64)
    per_request["mean_context_tokens"] = (float(records["decode_ctx_tokens"][decode].sum() / reqs.sum())
                                          if reqs.sum() else 0.0)
    flags = {name: int(((records["flags"] & bit) != 0).sum()) for bit, name in fmt.FLAGS.items()}
    return {"files": files, "steps": total, "time_s": float(t.sum()) / 1e9, "modes": modes, "batch": buckets,
            "per_prefill_token_us": per_token, "per_decode_request_us": per_request, "flags": flags,
            "prefill_tokens": int(records["prefill_tokens"].astype(np.int64).sum()),
            "prefix_tokens": int(records["prefix_tokens"].sum()),
            "decode_tokens": int(records["decode_tokens"].astype(np.int64).sum())}


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in [headers, *rows]]
    return "\n".join(lines)


def _setting(value: Any) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    return "none" if value is None else str(value)


def render(summary: dict[str, Any]) -> str:
    """The summary as text."""
    out = []
    files = summary["files"]
    engines = sorted({f"{f['engine']} {f['engine_version'] or ''}".strip() for f in files})
    out.append(f"{summary['steps']:,} steps in {len(files)} step log{'s' if len(files) != 1 else ''} "
               f"({', '.join(engines)}), {summary['time_s']:.3f} s of steps")
    for f in files:
        c = f["counts"]
        lost = [f"{c[k]:,} {what}" for k, what in (("dropped_cap", "past the size cap"),
                                                    ("dropped_ring", "dropped (the writer fell behind)"),
                                                    ("dropped_io", "not written (a write failed)"),
                                                    ("faults", "faults"), ("unmatched", "unmatched"))
                if c.get(k)]
        state = "closed" if f["closed"] else "not closed (its process ended without closing it)"
        out.append(f"  {f['path']}: rank {f['rank']}, pid {f['pid']}, {f['steps']:,} steps, {state}"
                   + (f"; {', '.join(lost)}" if lost else ""))
        if f["settings"]:
            out.append("    settings: " + ", ".join(f"{k} {_setting(v)}" for k, v in f["settings"].items()))
    if not summary["steps"]:
        return "\n".join(out)
    out.append("\nsteps by mode")
    out.append(_table(["mode", "steps", "share", "time s", "mean batch", "p50 ms", "p90 ms"],
                      [[m, f"{v['steps']:,}", f"{100 * v['share']:.1f}%", f"{v['time_s']:.3f}", f"{v['mean_batch']:.1f}",
                        f"{v['p50_ms']:.3f}", f"{v['p90_ms']:.3f}"] for m, v in summary["modes"].items()]))
    out.append("\nstep time by mode and batch size (requests)")
    out.append(_table(["mode", "batch", "steps", "p50 ms", "p90 ms"],
                      [[b["mode"], b["batch"], f"{b['steps']:,}", f"{b['p50_ms']:.3f}", f"{b['p90_ms']:.3f}"]
                       for b in summary["batch"]]))
    tok, req = summary["per_prefill_token_us"], summary["per_decode_request_us"]
    out.append("")
    out.append(f"time per prefill token: {tok['mean_us']:.3f} µs (extend steps: {tok['steps']:,}, "
               f"{tok['units']:,} tokens; median per step {tok['p50_us']:.3f} µs)")
    out.append(f"time per decode request: {req['mean_us']:.3f} µs (decode steps: {req['steps']:,}, "
               f"{req['units']:,} requests of {req['mean_context_tokens']:.0f} context tokens on average; "
               f"median per step {req['p50_us']:.3f} µs)")
    flagged = [f"{n:,} {name}" for name, n in summary["flags"].items() if n]
    if flagged:
        out.append("flags: " + ", ".join(flagged))
    return "\n".join(out)


# -- the command -----------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Summarize step logs (DPBOARD_STEP_LOG): steps by mode, step time by mode and batch size, "
                     "time per prefill token and per decode request.")
    p.add_argument("path", metavar="FILE_OR_DIR", help="a step log, or a directory of them (every steps-*.bin)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")


def run(args: argparse.Namespace) -> int:
    logs = [read_step_log(p) for p in step_log_paths(args.path)]
    summary = summarize(logs)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0
