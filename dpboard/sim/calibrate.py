"""A rank profile fitted from a real server's steps: the rank model's own terms, nothing else.

The simulator's rank (``dpboard.sim.model``) prices a prefill step as ``prefill_base +
prefill_token * tokens`` and a decode step as ``decode_base + decode_request * batch +
decode_kv_token * kv``; under DP attention a decode batch in a step where another rank extends pays
``eager_decode`` more (``dpboard.sim.stepping``). ``fit_profile`` fits exactly those terms to the
steps of a step log (docs/INTEGRATIONS.md, "Step log"), and the capacities (KV pool, running
batch limit, chunk) come from the log's header, as the server ran.

Why a robust fit: on a shared CPU both ranks stall together now and then (the HTTP server, the
detokenizer, the client), and a step's p90 at a fixed batch is several times its p50. Least squares
would follow the stalls; a least-absolute-deviation fit (iteratively reweighted) follows the typical
step, which is what the simulator's deterministic step should be. Terms stay >= 0 (the model's
validation refuses a negative cost): the fit takes the best of the subsets of terms.

The fit is refused, with what is missing, when the log cannot pin the model down: too few steps of a
kind, or steps of too few shapes (every prefill the same length, every decode batch the same size).
A term the log pins only loosely (its standard error over half its value) is fitted all the same and
named in ``Calibration.loose``.

A step log sees nothing outside the schedulers: the HTTP server, the tokenizer, the DP controller,
the detokenizer and the stream back. ``fit_frontend`` prices that path from lone requests sent to
the idle server: the TTFT the client saw less the one the fitted rank model gives the same request
alone, their median (the profile's ``frontend_ms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.options import count, number_in

# the fewest steps of each kind a fit stands on, and the fewest distinct shapes among them
MIN_STEPS = 30
MIN_SHAPES = 3
LOOSE = 0.5  # a term whose standard error is over this share of its value is named as loose
_IRLS_ROUNDS = 60
_EPS_S = 1e-6  # a residual below a microsecond weighs as one of a microsecond

EXTEND, DECODE, MIXED, IDLE = "extend", "decode", "mixed", "idle"


@dataclass(frozen=True)
class StepTable:
    """One rank's (or several ranks') recorded steps, as plain arrays of one length.

    ``mode`` holds "extend", "decode", "mixed" or "idle"; ``prefill_tokens`` the prompt tokens
    computed (cached ones not counted); ``decode_reqs`` the decode requests in the batch and
    ``decode_ctx_tokens`` their context tokens; ``group_extend`` whether the DP-attention group's step
    was an extend step (False without DP attention); ``duration_s`` the step's time.
    """

    mode: np.ndarray
    prefill_tokens: np.ndarray
    decode_reqs: np.ndarray
    decode_ctx_tokens: np.ndarray
    group_extend: np.ndarray
    duration_s: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.mode)
        for name in ("prefill_tokens", "decode_reqs", "decode_ctx_tokens", "group_extend", "duration_s"):
            if len(getattr(self, name)) != n:
                raise InvalidInputError(f"step table: {name} has {len(getattr(self, name))} rows, mode has {n}")


@dataclass(frozen=True)
class Term:
    key: str  # the profile key
    value: float  # in the key's unit
    stderr: float  # in the key's unit (nan: not estimated)


@dataclass(frozen=True)
class Calibration:
    terms: list[Term]
    settings: dict[str, int]  # the capacities from the header, as profile keys
    dp_attention: bool
    steps: dict[str, int]  # steps by mode in the log
    used: dict[str, int]  # steps each fit stood on
    error: dict[str, tuple[float, float]]  # kind -> (median, p90) absolute % error per step
    loose: list[str] = field(default_factory=list)  # terms the log pins only loosely

    def value(self, key: str) -> float:
        return next(t.value for t in self.terms if t.key == key)

    def profile_text(self, name: str, source: str, *, frontend_ms: float | None = None,
                     frontend_source: str = "") -> str:
        """The fit as a profile file ``dpboard sim --profile-file`` reads (``frontend_ms``: the
        front-end path's time, from ``fit_frontend`` or a user's own figure, and where it came from)."""
        lines = [
            f"# Fitted by `dpboard calibrate` from {source}: {self.used.get(EXTEND, 0)} prefill steps and "
            f"{self.used.get(DECODE, 0)} decode steps",
            "# (a least-absolute-deviation fit of the rank model's own terms; capacities from the log's header).",
            "# Absolute error per step, median / p90: "
            + "; ".join(f"{kind} {med:.1f} % / {p90:.1f} %" for kind, (med, p90) in self.error.items()),
        ]
        if self.loose:
            lines.append(f"# Pinned only loosely by this log (standard error over half the value): {', '.join(self.loose)}")
        lines += [
            f"name = {name}",
            f"description = fitted from a step log ({'DP attention, ' if self.dp_attention else ''}"
            f"{sum(self.steps.values())} steps)",
            f"source = dpboard calibrate {source}",
        ]
        lines += [f"{key} = {value}" for key, value in self.settings.items()]
        if self.dp_attention:
            lines.append("dp_attention = 1")
        lines += [f"{t.key} = {_fmt(t.value)}" for t in self.terms]
        if frontend_ms is not None:
            if frontend_source:
                lines.append(f"# frontend_ms: {frontend_source}")
            lines.append(f"frontend_ms = {_fmt(frontend_ms)}")
        return "\n".join(lines) + "\n"

    def report(self) -> str:
        """The fit in a few lines for a terminal."""
        out = ["steps: " + ", ".join(f"{k} {v}" for k, v in self.steps.items()) +
               f" (fitted on {self.used.get(EXTEND, 0)} prefill, {self.used.get(DECODE, 0)} decode)"]
        for t in self.terms:
            err = "" if math.isnan(t.stderr) else f" ± {_fmt(t.stderr)}"
            out.append(f"  {t.key:<20} {_fmt(t.value)}{err}")
        for kind, (med, p90) in self.error.items():
            out.append(f"fit error per {kind} step: median {med:.1f} %, p90 {p90:.1f} %")
        out.append("not pinned down by this log: " + (", ".join(self.loose) if self.loose else "none"))
        return "\n".join(out)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def fit_frontend(prompt_len: np.ndarray, output_len: np.ndarray, client_ttft_s: np.ndarray, rank: Any,
                 *, overlap: bool) -> tuple[float, float, float]:
    """The front-end path's time from lone requests on an idle server: per request, the TTFT the
    client saw less the TTFT the rank model ``rank`` gives it alone on an idle rank. Returns the
    median, the p10 and the p90 of that difference, in seconds. Refused with fewer than 5 requests
    (one stall would be the answer) or a median below 0 (the profile prices prefill above what the
    server took: refit it)."""
    from dpboard.sim.simulation import SimConfig, Simulation
    from dpboard.sim.trace import Trace

    n = len(client_ttft_s)
    if n < 5 or len(prompt_len) != n or len(output_len) != n:
        raise InvalidInputError(f"a front-end fit needs 5 or more lone requests with prompt, output and TTFT each, "
                                f"got {n} TTFTs, {len(prompt_len)} prompts, {len(output_len)} outputs")
    gap = 1000.0  # far apart: each request meets an idle rank
    trace = Trace(name="front-end probe", n_ranks=1, seed=0, arrival_s=np.arange(n) * gap,
                  prompt_len=np.asarray(prompt_len, np.int64), output_len=np.asarray(output_len, np.int64),
                  is_burst=np.zeros(n, bool))
    config = SimConfig(n_ranks=1, rank=rank, overlap_schedule=overlap).validate()
    result = Simulation(trace, "round_robin", config).run()
    modelled = np.array([r.first_token_s - r.arrival_s for r in sorted(result.requests, key=lambda r: r.arrival_s)])
    rest = np.asarray(client_ttft_s, np.float64) - modelled
    median, p10, p90 = (float(np.percentile(rest, q)) for q in (50, 10, 90))
    if median < 0:
        raise InvalidInputError(f"lone requests took {np.median(client_ttft_s) * 1e3:.1f} ms to a first token, the fitted "
                                f"profile gives them {np.median(modelled) * 1e3:.1f} ms: the profile prices prefill above "
                                "this server's; fit it from a log of this server")
    return median, p10, p90


@dataclass(frozen=True)
class _ModelSteps:
    """A step table as the rank model reads it: the columns as arrays, and which rows are a step of
    the model (``fit_profile`` fits those, ``by_shape`` compares them)."""

    mode: np.ndarray
    tokens: np.ndarray
    reqs: np.ndarray
    ctx: np.ndarray
    duration: np.ndarray
    group_extend: np.ndarray
    pre: np.ndarray  # a prefill step: an extend step with no decode requests in it
    dec_all: np.ndarray  # a decode step, whatever the group did
    dec: np.ndarray  # a decode step of the model: under DP attention the group's extend steps apart

    @classmethod
    def of(cls, table: StepTable) -> _ModelSteps:
        mode = np.asarray(table.mode).astype(str)
        tokens = np.asarray(table.prefill_tokens, dtype=np.float64)
        reqs = np.asarray(table.decode_reqs, dtype=np.float64)
        duration = np.asarray(table.duration_s, dtype=np.float64)
        group_extend = np.asarray(table.group_extend, dtype=bool)
        ok = np.isfinite(duration) & (duration > 0)
        # SGLang runs mixed steps only with --enable-mixed-chunk, which the model does not have
        pre = ok & (mode == EXTEND) & (tokens > 0) & (reqs == 0)
        dec_all = ok & (mode == DECODE) & (reqs > 0)
        return cls(mode, tokens, reqs, np.asarray(table.decode_ctx_tokens, dtype=np.float64), duration, group_extend,
                   pre, dec_all, dec_all & ~group_extend)


# batch shapes the recorded and the modelled step times are compared by: decode steps by the requests
# in the batch, prefill steps by the prompt tokens computed (low, high: inclusive)
DECODE_SHAPES = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 1 << 30))
PREFILL_SHAPES = ((1, 127), (128, 511), (512, 2047), (2048, 1 << 30))


def by_shape(table: StepTable, fit: Calibration) -> list[dict[str, Any]]:
    """Per batch shape, the recorded steps' time (p50, p90) beside the fitted model's for the same
    steps: whether the model's steps are the server's across the shapes it ran, not just on average
    (decode steps of a DP-attention group's extend steps apart, as the fit takes them)."""
    view = _ModelSteps.of(table)
    tokens, reqs, ctx, duration, pre, dec = view.tokens, view.reqs, view.ctx, view.duration, view.pre, view.dec
    model_pre = (fit.value("prefill_step_ms") * 1e-3 + fit.value("prefill_token_us") * 1e-6 * tokens)
    model_dec = (fit.value("decode_step_ms") * 1e-3 + fit.value("decode_request_us") * 1e-6 * reqs
                 + fit.value("decode_kv_token_ns") * 1e-9 * ctx)
    rows = []
    for kind, rows_of, size, shapes, model, unit in ((DECODE, dec, reqs, DECODE_SHAPES, model_dec, "requests"),
                                                    ("prefill", pre, tokens, PREFILL_SHAPES, model_pre, "tokens")):
        for low, high in shapes:
            picked = rows_of & (size >= low) & (size <= high)
            if not picked.any():
                continue
            real, modelled = duration[picked], model[picked]
            rows.append({"kind": kind, "shape": f"{low}+ {unit}" if high >= 1 << 30 else f"{low}-{high} {unit}",
                         "steps": int(picked.sum()),
                         "real_p50_ms": float(np.percentile(real, 50)) * 1e3,
                         "real_p90_ms": float(np.percentile(real, 90)) * 1e3,
                         "model_p50_ms": float(np.percentile(modelled, 50)) * 1e3,
                         "model_p90_ms": float(np.percentile(modelled, 90)) * 1e3})
    return rows


def fit_profile(table: StepTable, header: Mapping[str, object], *, min_steps: int = MIN_STEPS) -> Calibration:
    """The rank model's terms fitted to ``table``; ``header`` is the log's settings
    (``chunked_prefill_size``, ``max_running_requests``, ``max_total_tokens``, ``dp_attention``)."""
    view = _ModelSteps.of(table)
    mode, tokens, reqs, ctx, duration = view.mode, view.tokens, view.reqs, view.ctx, view.duration
    pre, dec, dec_all, group_extend = view.pre, view.dec, view.dec_all, view.group_extend
    steps = {kind: int((mode == kind).sum()) for kind in (EXTEND, DECODE, MIXED, IDLE)}
    dp_attention = bool(header.get("dp_attention", False))

    _enough("prefill", pre, tokens, "prompt-token counts", "prompts of several lengths", min_steps)
    _enough("decode", dec, reqs, "batch sizes", "a few requests at once, then more", min_steps)

    p_coef, p_err, p_pred = _fit(np.column_stack([np.ones(pre.sum()), tokens[pre]]), duration[pre])
    d_cols = np.column_stack([np.ones(dec.sum()), reqs[dec], ctx[dec]])
    d_coef, d_err, d_pred = _fit(d_cols, duration[dec])
    terms = [
        Term("prefill_step_ms", p_coef[0] * 1e3, p_err[0] * 1e3),
        Term("prefill_token_us", p_coef[1] * 1e6, p_err[1] * 1e6),
        Term("decode_step_ms", d_coef[0] * 1e3, d_err[0] * 1e3),
        Term("decode_request_us", d_coef[1] * 1e6, d_err[1] * 1e6),
        Term("decode_kv_token_ns", d_coef[2] * 1e9, d_err[2] * 1e9),
    ]
    error = {"prefill": _abs_pct(p_pred, duration[pre]), "decode": _abs_pct(d_pred, duration[dec])}
    used = {EXTEND: int(pre.sum()), DECODE: int(dec.sum())}
    loose = [t.key for t in terms if _is_loose(t)]
    if len(np.unique(ctx[dec])) < MIN_SHAPES:
        loose.append("decode_kv_token_ns")
    if dp_attention:
        eager = dec_all & group_extend
        if eager.sum() >= min_steps:
            base = np.column_stack([np.ones(eager.sum()), reqs[eager], ctx[eager]]) @ d_coef
            extra = duration[eager] - base
            value = max(0.0, float(np.median(extra)))
            spread = 1.2533 * 1.4826 * float(np.median(np.abs(extra - np.median(extra)))) / math.sqrt(eager.sum())
            term = Term("eager_decode_ms", value * 1e3, spread * 1e3)
            terms.append(term)
            used["eager"] = int(eager.sum())
            error["decode in an extend step"] = _abs_pct(base + value, duration[eager])
            if _is_loose(term):
                loose.append(term.key)
        else:
            loose.append("eager_decode_ms")
    return Calibration(terms=terms, settings=_capacities(header), dp_attention=dp_attention, steps=steps,
                       used=used, error=error, loose=sorted(set(loose), key=loose.index))


def _enough(kind: str, rows: np.ndarray, regressor: np.ndarray, shapes: str, hint: str, min_steps: int) -> None:
    n = int(rows.sum())
    if n < min_steps:
        raise InvalidInputError(
            f"the step log has {n} {kind} steps, the fit needs at least {min_steps}: record longer, with "
            f"traffic that has {hint}")
    distinct = len(np.unique(regressor[rows]))
    if distinct < MIN_SHAPES:
        raise InvalidInputError(
            f"the step log's {kind} steps have {distinct} distinct {shapes}, the fit needs at least "
            f"{MIN_SHAPES}: record traffic that has {hint}")


def _is_loose(term: Term) -> bool:
    return not math.isfinite(term.stderr) or term.stderr > LOOSE * abs(term.value) and term.value != 0 \
        or term.value == 0 and term.stderr > 0


def _abs_pct(pred: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    pct = 100.0 * np.abs(pred - actual) / actual
    return float(np.median(pct)), float(np.percentile(pct, 90))


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least absolute deviations with every coefficient >= 0: the best over the subsets of columns
    whose own fit is non-negative. Returns (coefficients, their standard errors, the fitted values)."""
    k = x.shape[1]
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for size in range(k, 0, -1):
        for cols in itertools.combinations(range(k), size):
            coef, weights = _lad(x[:, cols], y)
            if (coef < 0).any():
                continue
            loss = float(np.abs(x[:, cols] @ coef - y).sum())
            if best is None or loss < best[0] - 1e-12:
                full = np.zeros(k)
                full[list(cols)] = coef
                best = (loss, full, _stderr(x[:, cols], y, coef, weights, cols, k))
    assert best is not None  # a one-column fit of positive durations is never negative
    _, coef, err = best
    return coef, err, x @ coef


def _lad(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Iteratively reweighted least squares toward the least-absolute-deviation fit (a bounded number
    of rounds: it converges in a few tens on a step log)."""
    w = np.ones(len(y))
    coef = np.zeros(x.shape[1])
    for _ in range(_IRLS_ROUNDS):
        sw = np.sqrt(w)
        new, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
        done = np.allclose(new, coef, rtol=1e-9, atol=1e-15)
        coef = new
        if done:
            break
        w = 1.0 / np.maximum(np.abs(y - x @ coef), _EPS_S)
    return coef, w


def _stderr(x: np.ndarray, y: np.ndarray, coef: np.ndarray, weights: np.ndarray, cols: tuple[int, ...], k: int) -> np.ndarray:
    """Standard errors of a median regression: the residuals' robust scale (1.4826 MAD) times the
    median's efficiency factor sqrt(pi/2), through (X'X)^-1; a term left out has none (nan)."""
    out = np.full(k, math.nan)
    resid = y - x @ coef
    scale = 1.4826 * float(np.median(np.abs(resid - np.median(resid)))) * math.sqrt(math.pi / 2)
    try:
        cov = np.linalg.inv(x.T @ x) * scale**2
    except np.linalg.LinAlgError:
        return out
    out[list(cols)] = np.sqrt(np.clip(np.diag(cov), 0, None))
    return out


def _capacities(header: Mapping[str, object]) -> dict[str, int]:
    """The profile's capacity keys from the header, as the server ran; a missing one is refused."""
    keys = {"kv_capacity_tokens": "max_total_tokens", "max_running_requests": "max_running_requests",
            "chunked_prefill_size": "chunked_prefill_size"}
    out: dict[str, int] = {}
    for key, name in keys.items():
        value = header.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInputError(
                f"the step log's header has no usable {name} ({value!r}): record with a dpboard whose step "
                f"recorder writes it (docs/INTEGRATIONS.md, 'Step log')")
        out[key] = value
    if out["kv_capacity_tokens"] < 1 or out["max_running_requests"] < 1:
        raise InvalidInputError(f"the step log's header gives a server with no room: {out}")
    return out


def table_from_logs(logs: list[Any]) -> tuple[StepTable, dict[str, object]]:
    """The steps of step logs (``dpboard.steplog.reader.StepLogFile``: one per rank, or several runs of
    one server) as one table, and the settings their headers agree on; logs of servers set up
    differently are refused (one profile describes one setup)."""
    from dpboard.steplog import format as fmt
    from dpboard.steplog.reader import step_times

    if not logs:
        raise InvalidInputError("no step logs to fit: name a step log or a directory of them (DPBOARD_STEP_LOG)")
    settings: dict[str, object] = {}
    parts = []
    for log in logs:
        own = {k: log.settings.get(k) for k in ("chunked_prefill_size", "max_running_requests", "max_total_tokens",
                                                 "overlap", "dp_attention")}
        if not settings:
            settings = own
        elif own != settings:
            diff = ", ".join(f"{k} {settings[k]!r} vs {own[k]!r}" for k in own if own[k] != settings[k])
            raise InvalidInputError(f"step log {log.path} comes from a server set up otherwise than the first ({diff}): "
                                    f"fit each setup on its own")
        rec = log.records
        names = np.array([fmt.MODES.get(int(m), "other") for m in range(max(fmt.MODES) + 1)], dtype=object)
        parts.append(StepTable(
            mode=names[np.clip(rec["mode"], 0, max(fmt.MODES))].astype(str),
            prefill_tokens=rec["prefill_tokens"].astype(np.int64),
            decode_reqs=rec["decode_reqs"].astype(np.int64),
            decode_ctx_tokens=rec["decode_ctx_tokens"].astype(np.int64),
            group_extend=(rec["flags"] & fmt.GROUP_EXTEND) != 0,
            duration_s=step_times(rec) / 1e9,
        ))
    table = StepTable(*(np.concatenate([getattr(p, f.name) for p in parts])
                        for f in dataclasses.fields(StepTable)))
    return table, settings


# -- the command: ``dpboard calibrate`` ------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Fit the simulator's rank model to a server's recorded steps (DPBOARD_STEP_LOG) and write it "
                     "as a profile `dpboard sim --profile-file` reads; prints the terms, the fit error per step and "
                     "the terms the log could not pin down.")
    p.add_argument("paths", nargs="+", metavar="FILE_OR_DIR", help="step logs, or directories of them")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE", help="the profile file to write")
    p.add_argument("--name", default=None, help="the profile's name (default: the output file's stem)")
    p.add_argument("--frontend-ms", type=number_in(float, 0.0, 60_000.0, unit="milliseconds"), default=None, metavar="MS",
                   help="the front-end path's time per request, written as the profile's frontend_ms (what a lone "
                        "request's TTFT at the client exceeds the fitted prefill by; docs/TOOLS.md, dpboard calibrate)")
    p.add_argument("--min-steps", type=count(MIN_SHAPES, 1_000_000), default=MIN_STEPS,
                   help=f"the fewest prefill and decode steps a fit stands on (default {MIN_STEPS})")


def run(args: argparse.Namespace) -> int:
    from dpboard.steplog.reader import read_step_log, step_log_paths

    logs = [read_step_log(p) for path in args.paths for p in step_log_paths(path)]
    table, settings = table_from_logs(logs)
    fit = fit_profile(table, settings, min_steps=args.min_steps)
    out = Path(args.output)
    name = args.name or out.stem
    source = ", ".join(str(p) for p in args.paths)
    frontend_source = "given with --frontend-ms" if args.frontend_ms is not None else ""
    out.write_text(fit.profile_text(name, source, frontend_ms=args.frontend_ms, frontend_source=frontend_source),
                   encoding="utf-8")
    print(fit.report())
    print("step time by batch shape, recorded p50 / p90 beside the fitted model's (ms):")
    for row in by_shape(table, fit):
        print(f"  {row['kind']:<8} {row['shape']:<16} {row['steps']:>7} steps  {row['real_p50_ms']:8.2f} / "
              f"{row['real_p90_ms']:8.2f}   model {row['model_p50_ms']:8.2f} / {row['model_p90_ms']:8.2f}")
    print(f"wrote {out}: dpboard sim --profile-file {out}")
    return 0
