"""A rank profile fitted from a real server's steps: the rank model's own terms, nothing else.

The simulator's rank (``dpboard.sim.model``) prices a prefill step as ``prefill_base +
prefill_token * tokens + prefill_attention * pairs`` (attention's pairs of a token computed and a
token of its context; a step log has the batch's prompt tokens, prefix tokens and requests, so a
step's pairs are taken as its requests' even shares: ``(tokens * prefix + tokens**2 / 2) /
requests``) and a decode step as ``decode_base + decode_request * batch +
decode_kv_token * kv``, the one right after a prefill step ``decode_after_prefill`` more (the
prefilled requests join the running batch); under DP attention a decode batch in a step where
another rank extends is priced as the simulator's lockstep step prices it, from the prefill step's base:
``prefill_base + decode_request * batch + decode_kv_token * kv + eager_decode`` (``dpboard.sim.stepping``;
the ranks of a group step together, so a decoding rank's recorded time in such a step is the group's). ``fit_profile`` fits exactly those terms to the
steps of a step log (docs/INTEGRATIONS.md, "Step log"), and the capacities (KV pool, running
batch limit, chunk) come from the log's header, as the server ran.

Which average: the simulator's step is deterministic, and a step's time on a real server is not: on
a shared CPU both ranks stall together now and then (the HTTP server, the detokenizer, the client)
and a step's p90 at a fixed batch is several times its p50. What a request sees decides which
average a deterministic step should have. Its first token waits on one prefill step (at a light
load, TTFT p50 is the median prefill's), its TPOT is the mean of its many decode steps (stalls
included). So the default fit (``request``) fits prefill steps by least absolute deviations
(iteratively reweighted: the median step, a few stalled steps of thousands of tokens cannot pull
it) and decode steps by least squares (the mean step: sums of simulated decode steps are sums of
recorded ones). ``mean`` and ``median`` fit both kinds alike. Terms stay >= 0 (the model's
validation refuses a negative cost): each fit takes the best of the subsets of terms.

Where the forward runs in the scheduler's thread (a CPU), SGLang's ``run_batch`` returns only once the
forward is done; the recorder's launch times say so (``launch_ns`` most of a step's time), and the
profile gets ``sync_forward = 1``: under the overlap scheduler a step's tokens come out after the
next step's forward (``dpboard.sim.model``), ``result_share`` of that step's time from its start (the
median of the log's steps: each step's result processed, against its successor's start and the start
of the step after).

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
ZERO_SHARE = 0.05  # ... and its standard error moves a typical step by more than this share
_IRLS_ROUNDS = 60
_EPS_S = 1e-6  # a residual below a microsecond weighs as one of a microsecond

EXTEND, DECODE, MIXED, IDLE = "extend", "decode", "mixed", "idle"
# the fit's average: what a step of a given shape takes in the model
FITS = {"request": "prefill by its median step (least absolute deviations), decode by its mean step (least squares)",
        "mean": "least-squares (mean step)", "median": "least-absolute-deviation (median step)"}
# per fit, the average of (prefill steps, decode steps)
_AVERAGES = {"request": ("median", "mean"), "mean": ("mean", "mean"), "median": ("median", "median")}
SYNC_SHARE = 0.5  # launch over more than this share of the median step: the forward ran in the scheduler's thread


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
    launch_s: np.ndarray | None = None  # time to the batch's launch (run_batch returned); None: not recorded
    prefix_tokens: np.ndarray | None = None  # prefill steps: tokens already in KV (None: none)
    prefill_reqs: np.ndarray | None = None  # prefill steps: requests prefilling (None: one each)
    after_prefill: np.ndarray | None = None  # the step before it (in its log) was a prefill step (None: unknown)
    # where in the next step's time (its start to the start of the one after, a share) this step's
    # result was processed; NaN where the next step was not launched before it (None: not known)
    result_in_next: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.mode)
        for name in ("prefill_tokens", "decode_reqs", "decode_ctx_tokens", "group_extend", "duration_s", "launch_s",
                     "prefix_tokens", "prefill_reqs", "after_prefill", "result_in_next"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
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
    fit: str = "request"  # FITS: the average each kind of step's time is fitted to
    sync_forward: bool | None = None  # the forward ran in the scheduler's thread (None: no launch times)
    result_share: float | None = None  # with sync_forward: where in the next step a result came out (median)

    def value(self, key: str, default: float | None = None) -> float:
        """The fitted term ``key``; ``default`` where the fit has no such term (None: that is an error)."""
        found = next((t.value for t in self.terms if t.key == key), default)
        if found is None:
            raise KeyError(f"the fit has no term {key!r}")
        return found

    def profile_text(self, name: str, source: str, *, frontend_ms: float | None = None,
                     frontend_source: str = "") -> str:
        """The fit as a profile file ``dpboard sim --profile-file`` reads (``frontend_ms``: the
        front-end path's time, from ``fit_frontend`` or a user's own figure, and where it came from)."""
        lines = [
            f"# Fitted by `dpboard calibrate` from {source}: {self.used.get(EXTEND, 0)} prefill steps and "
            f"{self.used.get(DECODE, 0)} decode steps",
            f"# (a {FITS[self.fit]} fit of the rank model's own terms; capacities from the log's header).",
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
        if self.sync_forward:
            lines.append("# the forward ran in the scheduler's thread (run_batch returned once it was done)")
            lines.append("sync_forward = 1")
            if self.result_share is not None:
                lines.append("# where in the next step's time a step's result was processed (median share, from its start)")
                lines.append(f"result_share = {self.result_share:.3g}")
        if frontend_ms is not None:
            if frontend_source:
                lines.append(f"# frontend_ms: {frontend_source}")
            lines.append(f"frontend_ms = {_fmt(frontend_ms)}")
        return "\n".join(lines) + "\n"

    def report(self) -> str:
        """The fit in a few lines for a terminal."""
        out = ["steps: " + ", ".join(f"{k} {v}" for k, v in self.steps.items()) +
               f" (fitted on {self.used.get(EXTEND, 0)} prefill, {self.used.get(DECODE, 0)} decode; "
               f"{FITS[self.fit]})"]
        for t in self.terms:
            err = "" if math.isnan(t.stderr) else f" ± {_fmt(t.stderr)}"
            out.append(f"  {t.key:<20} {_fmt(t.value)}{err}")
        for kind, (med, p90) in self.error.items():
            out.append(f"fit error per {kind} step: median {med:.1f} %, p90 {p90:.1f} %")
        if self.sync_forward is not None:
            out.append("the forward ran " + ("in the scheduler's thread (sync_forward = 1)" if self.sync_forward
                                              else "apart from the scheduler's thread (a device's launch)"))
        if self.sync_forward and self.result_share is not None:
            out.append(f"a step's result came out {self.result_share:.0%} into the next step (result_share)")
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
    pairs: np.ndarray  # a prefill step's attention pairs, its requests taken as even shares
    reqs: np.ndarray
    ctx: np.ndarray
    duration: np.ndarray
    group_extend: np.ndarray
    pre: np.ndarray  # a prefill step: an extend step with no decode requests in it
    dec_all: np.ndarray  # a decode step, whatever the group did
    dec: np.ndarray  # a decode step of the model: right after a prefill, or in the group's extend step, apart
    after: np.ndarray  # a decode step right after the rank's prefill step (not in a group's extend step)
    eager: np.ndarray  # DP attention: a decode step in the group's extend step (not right after a prefill)

    @classmethod
    def of(cls, table: StepTable) -> _ModelSteps:
        mode = np.asarray(table.mode).astype(str)
        tokens = np.asarray(table.prefill_tokens, dtype=np.float64)
        reqs = np.asarray(table.decode_reqs, dtype=np.float64)
        duration = np.asarray(table.duration_s, dtype=np.float64)
        group_extend = np.asarray(table.group_extend, dtype=bool)
        prefix = np.zeros_like(tokens) if table.prefix_tokens is None else np.asarray(table.prefix_tokens, np.float64)
        shares = np.ones_like(tokens) if table.prefill_reqs is None else np.maximum(
            np.asarray(table.prefill_reqs, np.float64), 1.0)
        pairs = (tokens * prefix + tokens * tokens / 2) / shares
        ok = np.isfinite(duration) & (duration > 0)
        pre = ok & _prefill_steps(mode == EXTEND, tokens, reqs)
        dec_all = ok & (mode == DECODE) & (reqs > 0)
        follows = np.zeros(len(mode), bool) if table.after_prefill is None else np.asarray(table.after_prefill, bool)
        return cls(mode, tokens, pairs, reqs, np.asarray(table.decode_ctx_tokens, dtype=np.float64), duration, group_extend,
                   pre, dec_all, dec=dec_all & ~group_extend & ~follows, after=dec_all & ~group_extend & follows,
                   eager=dec_all & group_extend & ~follows)


def _prefill_steps(extend: np.ndarray, tokens: np.ndarray, decode_reqs: np.ndarray) -> np.ndarray:
    """A prefill step of the model: an extend step with prompt tokens and no decode requests in it
    (SGLang runs mixed steps only with --enable-mixed-chunk, which the model does not have)."""
    return extend & (tokens > 0) & (decode_reqs == 0)


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
    model_pre = (fit.value("prefill_step_ms") * 1e-3 + fit.value("prefill_token_us") * 1e-6 * tokens
                 + fit.value("prefill_attention_ps") * 1e-12 * view.pairs)
    dec = dec | view.after
    model_dec = (fit.value("decode_step_ms") * 1e-3 + fit.value("decode_request_us") * 1e-6 * reqs
                 + fit.value("decode_kv_token_ns") * 1e-9 * ctx
                 + fit.value("decode_after_prefill_ms", 0.0) * 1e-3 * view.after)
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


def fit_profile(table: StepTable, header: Mapping[str, object], *, min_steps: int = MIN_STEPS,
                fit: str = "request") -> Calibration:
    """The rank model's terms fitted to ``table``; ``header`` is the log's settings
    (``chunked_prefill_size``, ``max_running_requests``, ``max_total_tokens``, ``dp_attention``);
    ``fit`` the averages (``FITS``: ``request``, ``mean`` or ``median``)."""
    if fit not in FITS:
        raise InvalidInputError(f"fit {fit!r} is not one of {', '.join(FITS)}")
    view = _ModelSteps.of(table)
    mode, tokens, reqs, ctx, duration = view.mode, view.tokens, view.reqs, view.ctx, view.duration
    pre, dec = view.pre, view.dec
    steps = {kind: int((mode == kind).sum()) for kind in (EXTEND, DECODE, MIXED, IDLE)}
    dp_attention = bool(header.get("dp_attention", False))

    _enough("prefill", pre, tokens, "prompt-token counts", "prompts of several lengths", min_steps)
    _enough("decode", dec, reqs, "batch sizes", "a few requests at once, then more", min_steps)

    p_cols = np.column_stack([np.ones(pre.sum()), tokens[pre], view.pairs[pre]])
    prefill_average, decode_average = _AVERAGES[fit]
    p_coef, p_err, p_pred = _fit(p_cols, duration[pre], prefill_average)
    d_cols = np.column_stack([np.ones(dec.sum()), reqs[dec], ctx[dec]])
    d_coef, d_err, d_pred = _fit(d_cols, duration[dec], decode_average)
    terms = [
        Term("prefill_step_ms", p_coef[0] * 1e3, p_err[0] * 1e3),
        Term("prefill_token_us", p_coef[1] * 1e6, p_err[1] * 1e6),
        Term("prefill_attention_ps", p_coef[2] * 1e12, p_err[2] * 1e12),
        Term("decode_step_ms", d_coef[0] * 1e3, d_err[0] * 1e3),
        Term("decode_request_us", d_coef[1] * 1e6, d_err[1] * 1e6),
        Term("decode_kv_token_ns", d_coef[2] * 1e9, d_err[2] * 1e9),
    ]
    error = {"prefill": _abs_pct(p_pred, duration[pre]), "decode": _abs_pct(d_pred, duration[dec])}
    used = {EXTEND: int(pre.sum()), DECODE: int(dec.sum())}
    loose = [t.key for t, is_loose in zip(terms, [*_loose(p_cols, duration[pre], p_coef, p_err),
                                                   *_loose(d_cols, duration[dec], d_coef, d_err)], strict=True)
             if is_loose]
    if len(np.unique(ctx[dec])) < MIN_SHAPES:
        loose.append("decode_kv_token_ns")
    # what a decode step of a kind costs over the fitted decode step: right after the rank's prefill,
    # and under DP attention in the group's extend step (a decode step of both kinds counts for the first)
    # (each over its step's fixed cost: the simulator's lockstep step starts from the prefill step's
    # base when any rank extends, dpboard.sim.stepping, so eager_decode is priced over that base)
    extras = [("decode_after_prefill_ms", "decode right after a prefill", view.after, "after prefill", d_coef[0])]
    if dp_attention:
        extras.append(("eager_decode_ms", "decode in an extend step", view.eager, "eager", p_coef[0]))
    typical_decode = float(np.median(duration[dec]))
    for key, label, rows, used_as, step_base in extras:
        if rows.sum() < min_steps:
            loose.append(key)
            continue
        base = step_base + d_coef[1] * reqs[rows] + d_coef[2] * ctx[rows]
        extra = duration[rows] - base
        center = float(np.mean(extra) if decode_average == "mean" else np.median(extra))
        value = max(0.0, center)
        spread = _scale(extra - center, decode_average, dof=0) / math.sqrt(rows.sum())
        terms.append(Term(key, value * 1e3, spread * 1e3))
        used[used_as] = int(rows.sum())
        error[label] = _abs_pct(base + value, duration[rows])
        if _is_loose(value, spread, 1.0, typical_decode):
            loose.append(key)
    return Calibration(terms=terms, settings=_capacities(header), dp_attention=dp_attention, steps=steps,
                       used=used, error=error, loose=sorted(set(loose), key=loose.index), fit=fit,
                       sync_forward=(sync := _sync_forward(table, view)),
                       result_share=_result_share(table) if sync else None)


def _sync_forward(table: StepTable, view: _ModelSteps) -> bool | None:
    """Whether the forward ran in the scheduler's thread: the launch (run_batch) took most of the
    median step of the model. None when the log has no launch times (an older log, vLLM)."""
    if table.launch_s is None:
        return None
    rows = (view.pre | view.dec_all) & (np.asarray(table.launch_s) > 0)
    if rows.sum() < MIN_STEPS:
        return None
    share = np.asarray(table.launch_s, dtype=np.float64)[rows] / view.duration[rows]
    return bool(np.median(share) > SYNC_SHARE)


def _result_share(table: StepTable) -> float | None:
    """The median share of the next step's time at which a step's result was processed; None where the
    log cannot say (no step had its successor launched before its result)."""
    if table.result_in_next is None:
        return None
    shares = np.asarray(table.result_in_next, dtype=np.float64)
    shares = shares[np.isfinite(shares)]
    if len(shares) < MIN_STEPS:
        return None
    return float(np.clip(np.median(shares), 0.01, 1.0))


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


def _loose(x: np.ndarray, y: np.ndarray, coef: np.ndarray, err: np.ndarray) -> list[bool]:
    """Per column, whether the log leaves the term loose: its standard error is over ``LOOSE`` of its
    value and moves a typical step by more than ``ZERO_SHARE`` (a term the log pins near 0, say a
    GPU's prefill with no measurable attention term, is pinned, not loose)."""
    typical_step = float(np.median(y))
    return [_is_loose(coef[j], err[j], float(np.median(x[:, j])), typical_step) for j in range(x.shape[1])]


def _is_loose(value: float, stderr: float, regressor: float, typical_step: float) -> bool:
    """A term of ``value`` and ``stderr`` per unit of its regressor (``regressor``: a typical step's
    amount of it) is loose when the error is over ``LOOSE`` of the value and moves that step by more
    than ``ZERO_SHARE``."""
    return not math.isfinite(stderr) or (stderr > LOOSE * value and stderr * regressor > ZERO_SHARE * typical_step)


def _abs_pct(pred: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    pct = 100.0 * np.abs(pred - actual) / actual
    return float(np.median(pct)), float(np.percentile(pct, 90))


def _fit(x: np.ndarray, y: np.ndarray, average: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least squares (``mean``) or least absolute deviations (``median``) with every coefficient
    >= 0: the best over the subsets of columns whose own fit is non-negative. Returns (coefficients,
    their standard errors, the fitted values)."""
    k = x.shape[1]
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for size in range(k, 0, -1):
        for cols in itertools.combinations(range(k), size):
            if average == "mean":
                coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            else:
                coef, _ = _lad(x[:, cols], y)
            if (coef < 0).any():
                continue
            resid = x[:, cols] @ coef - y
            loss = float((resid**2).sum() if average == "mean" else np.abs(resid).sum())
            if best is None or loss < best[0] * (1 - 1e-9):
                full = np.zeros(k)
                full[list(cols)] = coef
                best = (loss, full, _stderr(x[:, cols], y, coef, cols, k, average))
    assert best is not None  # a one-column fit of positive durations is never negative
    _, coef, err = best
    left_out = ~np.isfinite(err)
    if left_out.any():  # a term held at 0: its standard error as the fit with every term has it
        if average == "mean":
            whole, *_ = np.linalg.lstsq(x, y, rcond=None)
        else:
            whole, _ = _lad(x, y)
        err[left_out] = _stderr(x, y, whole, tuple(range(k)), k, average)[left_out]
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


def _scale(resid: np.ndarray, average: str, dof: int) -> float:
    """The residuals' scale behind a standard error: for least squares their root mean square over
    ``len - dof`` (``dof`` terms fitted); for a median, their robust scale (1.4826 MAD) times the
    median's efficiency factor sqrt(pi/2)."""
    if average == "mean":
        return math.sqrt(float((resid**2).sum()) / max(1, len(resid) - dof))
    return 1.4826 * float(np.median(np.abs(resid - np.median(resid)))) * math.sqrt(math.pi / 2)


def _stderr(x: np.ndarray, y: np.ndarray, coef: np.ndarray, cols: tuple[int, ...], k: int, average: str) -> np.ndarray:
    """Standard errors through (X'X)^-1: of least squares, the residuals' standard deviation; of a
    median regression, their robust scale (1.4826 MAD) times the median's efficiency factor
    sqrt(pi/2). A term left out has none (nan)."""
    out = np.full(k, math.nan)
    scale = _scale(y - x @ coef, average, dof=len(cols))
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
            launch_s=rec["launch_ns"] / 1e9,  # 0 where not recorded (the reader gives every version this field)
            prefix_tokens=rec["prefix_tokens"].astype(np.int64),
            prefill_reqs=rec["prefill_reqs"].astype(np.int64),
            after_prefill=np.concatenate([[False], _prefill_steps(rec["mode"] == fmt.EXTEND, rec["prefill_tokens"],
                                                                  rec["decode_reqs"])])[:-1],
            result_in_next=_result_in_next(rec),
        ))
    table = StepTable(*(np.concatenate([getattr(p, f.name) for p in parts])
                        for f in dataclasses.fields(StepTable)))
    if not table.launch_s.any():
        table = dataclasses.replace(table, launch_s=None)  # no launch recorded (an older log, vLLM)
    return table, settings


def _result_in_next(rec: np.ndarray) -> np.ndarray:
    """Per step of a log (in its order): where in the next step's time, as a share from its start to the
    start of the step after, this step's result was processed; NaN where the next step did not overlap
    it (``OVERLAPPED`` not set) or the log has no step after the next."""
    from dpboard.steplog import format as fmt

    start = rec["t_start_ns"].astype(np.float64)
    end = start + rec["duration_ns"]
    out = np.full(len(rec), np.nan)
    if len(rec) < 3:
        return out
    span = start[2:] - start[1:-1]
    overlapped = (rec["flags"][:-2] & fmt.OVERLAPPED) != 0
    ok = overlapped & (span > 0)
    share = np.divide(end[:-2] - start[1:-1], span, out=np.full(len(span), np.nan), where=ok)
    out[:-2] = np.where(ok & (share > 0) & (share <= 1), share, np.nan)
    return out


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
    p.add_argument("--fit", choices=tuple(FITS), default="request",
                   help="the average a step's time is fitted to: request (the default: prefill steps by their median, "
                        "a first token waits on one; decode steps by their mean, a TPOT is the mean of many), mean "
                        "(least squares for both) or median (least absolute deviations for both)")
    p.add_argument("--min-steps", type=count(MIN_SHAPES, 1_000_000), default=MIN_STEPS,
                   help=f"the fewest prefill and decode steps a fit stands on (default {MIN_STEPS})")


def run(args: argparse.Namespace) -> int:
    from dpboard.steplog.reader import read_step_log, step_log_paths

    logs = [read_step_log(p) for path in args.paths for p in step_log_paths(path)]
    table, settings = table_from_logs(logs)
    fit = fit_profile(table, settings, min_steps=args.min_steps, fit=args.fit)
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
