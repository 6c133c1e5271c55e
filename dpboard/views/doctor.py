"""``dpboard doctor [BOARD]``: the data-parallel troubleshooting checklist, answered from a live board.

"Why do all requests go to one DP rank?" The checklist asks whether dp_size is really > 1, which
load-balance method is in effect, whether requests carry ``routed_dp_rank`` or ``bootstrap_room``,
whether the loads are one-sided, whether a load-aware method refreshes too often or without its
throttle, and whether a PD prefill server was switched to round robin (decode then waits forever
for its KV). The board answers half of it; the dispatcher's own record
(``dpboard.board.dispatch_record``) the rest.

Where vLLM's API servers keep a sent record, each engine's requests in flight (sent, not yet
received) are read too (``dpboard.views.rows.in_flight``: read-only, none created).

``take_sample`` reads both once into a ``Sample`` of plain values; ``diagnose(samples)`` is the pure
core: from samples over a window (the first and the last give the counters' deltas, every one the
loads) it returns ``Finding``s, most serious first, each with its evidence, the likely cause in the
seed's terms and the fix. Each question of the checklist is one rule, a function of the ``Window``
(the samples and what is worked out from them once: the live ranks, their mean loads, the
dispatchers' counts) returning zero or more findings; ``RULES`` lists them in the order their
findings are listed within a severity, and ``diagnose`` runs them all. ``DoctorWatch`` keeps a short
rolling window of samples for ``top`` and ``serve``. Imports the board only: no Numba, no CuPy.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpboard.board import DEFAULT_STALE_AFTER, Board, BoardReader, list_boards, process_alive
from dpboard.board.dispatch_record import DispatchRowSample, read_dispatch_record
from dpboard.board.stale import stale_after
from dpboard.errors import DpboardError, InvalidInputError, NotFoundError
from dpboard.methods import AUTO_PICKS, METHODS, Delivery, Deployment, LoadBalanceMethod, MethodSpec
from dpboard.options import count, seconds
from dpboard.snapshot import DETAIL_FIELD_OFFSETS, DETAIL_FLAG, DETAIL_MODE_BYTES, DETAIL_PRESENT, SlotStatus
from dpboard.views.rows import in_flight

DEFAULT_WINDOW = 30.0
PROGRESS_EVERY = 1.0  # seconds between two updates of doctor's progress count on a terminal
HEALTHY_WINDOW = 1.0  # seconds of samples before top's header calls a board healthy
SAMPLES = 7  # reads over a window: at its start, its end and five between
SEVERITIES = ("critical", "warning", "info")
# The methods as the dispatch record names them, each with its row of the method table
# (dpboard.methods): a rule asks a dispatcher's row what it reads and how it places a request, and
# a finding names the methods it suggests from the table
_ROWS: dict[str, MethodSpec] = {m.value: spec for m, spec in METHODS.items()}
LOAD_UNAWARE = tuple(name for name, spec in _ROWS.items() if not spec.is_load_aware)
_PREFILL_PICK = AUTO_PICKS[Deployment.PD_PREFILL].value  # the stable room mapping PD prefill needs
_M = LoadBalanceMethod
SGLANG_THROTTLE = 0.02  # seconds: SGLang refreshes its budget at most every 20 ms
ROUTED_SHARE = 0.8  # above this share of requests pinned to one rank by routed_dp_rank: a finding
SKEWED = 1.5  # max / mean at or above this: one-sided
EVEN = 1.2  # max / mean below this: even
# A ratio of small loads says nothing: 0 and 293 tokens on ranks of 1M tokens each is a max/mean of
# 2 on a balanced, nearly idle deployment. Loads are judged one-sided only when the busiest rank's
# mean exceeds the idlest's by this share of their KV capacity (tokens) ...
SKEW_FLOOR_SHARE = 0.02
SKEW_FLOOR_REQUESTS = 4  # ... or, counted in requests (no capacity known), by this many requests
KV_FULL = 0.9
KV_ROOMY = 0.7
STUCK_WINDOW = 1.0  # seconds of samples before requests in flight that never arrive are a finding
MAX_WATCH_SLOTS = 1024  # top and serve diagnose boards up to this size as they go
_LIVE, _STALE, _TORN = SlotStatus.LIVE.label, SlotStatus.STALE.label, SlotStatus.TORN.label
_DISAGG = DETAIL_PRESENT | DETAIL_FLAG["disaggregation"]
_MODE_AT = DETAIL_FIELD_OFFSETS["disaggregation_mode"]
_WORD = struct.Struct("<q")  # the flags word and the PD queues, read from a slot's detail bytes
_PD_QUEUES = [(f, DETAIL_FIELD_OFFSETS[f"disaggregation_{f}"]) for f in (
    "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs")]


@dataclass(frozen=True)
class Finding:
    severity: str  # "critical", "warning" or "info"
    title: str
    evidence: str
    cause: str
    fix: str
    id: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "severity": self.severity, "title": self.title, "evidence": self.evidence,
                "cause": self.cause, "fix": self.fix}


@dataclass
class Sample:
    """One read of a board and its dispatch record, as plain values."""

    t: float  # time.monotonic() seconds
    board: str
    n_slots: int
    ranks: list[dict[str, Any]] = field(default_factory=list)
    dispatch: list[DispatchRowSample] | None = None  # None: the board has no dispatch record (or it is refused)
    record_refused: str | None = None  # why the file at the record's name is not read (another user's, ...)
    in_flight: list[int] | None = None  # per slot, sent and not yet received (None: no sent record)


def shown(text: str) -> str:
    """``text`` with every control character escaped (``\x1b``, ``\n``, ...): what a record holds is
    written by a process, maybe a --trust-uid user's, and never reaches a terminal as a control sequence."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _places(method: str, delivery: Delivery) -> bool:
    """The record's ``method`` (a name) places a request by ``delivery``, as its row says; a name the
    table does not know (another dpboard's) places by none."""
    spec = _ROWS.get(method)
    return spec is not None and spec.delivery is delivery


def take_sample(board: Board, reader: BoardReader, *, trust_uids: tuple[int, ...] = ()) -> Sample:
    """Every slot of ``board`` (with its detail's PD queues, and who holds it) and its dispatch record,
    as plain values from the C reader (no NumPy: ``dpboard doctor`` starts as fast as ``ls``)."""
    now = time.monotonic()
    now_ns = time.monotonic_ns()
    ranks = []
    for rank in range(board.n_slots):
        status, snap, raw = reader.read_detailed(rank)
        owner = board.owner_pid(rank)
        load = snap._asdict() if snap is not None else {}
        pid = load["writer_pid"] if status.has_snapshot else owner
        row: dict[str, Any] = {
            "rank": rank, "status": status.label, "pid": pid, "owner_pid": owner,
            "pid_alive": bool(pid) and process_alive(pid),
            "age_s": (now_ns - load["monotonic_ns"]) / 1e9 if status.has_snapshot else None,
            **{f: load.get(f, 0) for f in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                                           "num_total_tokens", "max_total_num_tokens", "num_received_reqs",
                                           "publish_seq")},
            "pd": None,
        }
        if raw is not None and _WORD.unpack_from(raw, 0)[0] & _DISAGG == _DISAGG:
            mode = shown(raw[_MODE_AT: _MODE_AT + DETAIL_MODE_BYTES].rstrip(b"\0").decode(errors="replace"))
            row["pd"] = {"mode": mode, **{f: _WORD.unpack_from(raw, at)[0] for f, at in _PD_QUEUES}}
        ranks.append(row)
    refused = None
    try:
        dispatch = read_dispatch_record(board.name, trust_uids=trust_uids)
    except DpboardError as e:  # a file dpboard refuses at the record's name: itself a finding
        dispatch, refused = None, shown(str(e))
    for row in dispatch or []:
        row.method, row.mode = shown(row.method), shown(row.mode)
    flying = in_flight(board.name, board.generation, [r["num_received_reqs"] for r in ranks], trust_uids=trust_uids)
    return Sample(now, board.name, board.n_slots, ranks, dispatch, refused, flying)


# -- the core ----------------------------------------------------------------------------------------


def _ratio(values: Sequence[float]) -> float | None:
    """max / mean (1.0: even); None with fewer than two values or nothing in them."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "-"


def _ranks(ranks: Iterable[int]) -> str:
    r = list(ranks)
    return ("rank " if len(r) == 1 else "ranks ") + ", ".join(str(x) for x in r)


def _mean_loads(samples: Sequence[Sample]) -> tuple[dict[int, float], float]:
    """Per rank LIVE in the last sample: its mean load over the samples in which it was LIVE (total
    tokens; queued and running requests where no rank reports tokens); and the gap between the
    busiest and the idlest that makes their ratio worth judging (``SKEW_FLOOR_SHARE`` of the ranks'
    mean KV capacity, ``SKEW_FLOOR_REQUESTS`` in requests or where no rank reports a capacity)."""
    last = samples[-1]
    live = [r["rank"] for r in last.ranks if r["status"] == _LIVE]
    key = "num_total_tokens"
    if not any(s.ranks[k][key] for s in samples for k in live if s.ranks[k]["status"] == _LIVE):
        key = "num_waiting_reqs"
    out = {}
    capacities = []
    for k in live:
        seen = [s.ranks[k] for s in samples if len(s.ranks) > k and s.ranks[k]["status"] == _LIVE]
        values = [r[key] + (r["num_running_reqs"] if key == "num_waiting_reqs" else 0) for r in seen]
        out[k] = sum(values) / len(values)
        capacities += [r["max_total_num_tokens"] for r in seen if r["max_total_num_tokens"] > 0]
    if key == "num_total_tokens" and capacities:
        return out, SKEW_FLOOR_SHARE * sum(capacities) / len(capacities)
    return out, float(SKEW_FLOOR_REQUESTS)


def _one_sided(loads: dict[int, float], ratio: float | None, floor: float) -> bool:
    """Loads one-sided: max/mean at least SKEWED, and the busiest above the idlest by ``floor``."""
    return ratio is not None and ratio >= SKEWED and max(loads.values()) - min(loads.values()) >= floor


@dataclass
class _Dispatch:
    """The live dispatchers' counts over the window (their rows' deltas, summed)."""

    rows: list[DispatchRowSample]
    counts: dict[str, int]
    per_rank: list[int]
    routed_per_rank: list[int]
    refresh_rates: list[tuple[DispatchRowSample, float]]

    @property
    def methods(self) -> set[str]:
        return {r.method for r in self.rows}


def _dispatch_over(first: Sample, last: Sample, dt: float) -> _Dispatch | None:
    if not last.dispatch:
        return None
    before = {r.row: r for r in (first.dispatch or []) if r.pid}
    # a plugin's row is published as requests come: an idle dispatcher's row ages, and is still its own
    rows = [r for r in last.dispatch if r.alive]
    if not rows:
        return None
    n = last.n_slots
    counts = dict.fromkeys(rows[0].counts, 0)
    per_rank, routed = [0] * n, [0] * n
    rates = []
    for row in rows:
        old = before.get(row.row)
        if old is not None and old.pid != row.pid:
            old = None  # another process took the row over: its counts began again
        if old is not None:  # a row that appeared during the window has no start to count from
            for name, value in row.counts.items():
                counts[name] += value - old.counts[name]
            for k in range(min(n, len(row.per_rank))):
                per_rank[k] += row.per_rank[k] - old.per_rank[k]
                routed[k] += row.routed_per_rank[k] - old.routed_per_rank[k]
            if dt > 0:
                rates.append((row, (row.counts["refreshes"] - old.counts["refreshes"]) / dt))
    return _Dispatch(rows, counts, per_rank, routed, rates)


def _stuck_in_flight(samples: Sequence[Sample]) -> list[tuple[int, int]]:
    """(rank, in flight at the end) of the ranks with requests in flight in every sample while their
    received count did not move: what was sent there is not arriving."""
    if any(s.in_flight is None for s in samples) or len(samples) < 2:
        return []
    first, last = samples[0], samples[-1]
    out = []
    for k in range(min(len(last.ranks), len(last.in_flight))):
        if (all(k < len(s.in_flight) and s.in_flight[k] > 0 for s in samples)
                and first.ranks[k]["num_received_reqs"] == last.ranks[k]["num_received_reqs"]):
            out.append((k, last.in_flight[k]))
    return out


def _publish_rate(first: Sample, last: Sample, dt: float) -> float | None:
    """The mean publishes per second of the ranks LIVE at both ends."""
    if dt <= 0:
        return None
    rates = [(b["publish_seq"] - a["publish_seq"]) / dt for a, b in zip(first.ranks, last.ranks, strict=False)
             if a["status"] == b["status"] == _LIVE and b["publish_seq"] >= a["publish_seq"]]
    return sum(rates) / len(rates) if rates else None


def _dispatch_per_rank(first: Sample, last: Sample, disp: _Dispatch | None, live: list[int]) -> dict[int, int] | None:
    """Requests per live rank over the window: the dispatcher's counts, else the board's received."""
    if len(live) < 2:
        return None
    if disp is not None:
        sent = {k: disp.per_rank[k] for k in live}
    else:
        sent = {k: max(0, last.ranks[k]["num_received_reqs"] - first.ranks[k]["num_received_reqs"]) for k in live}
    return sent if sum(sent.values()) >= 10 * len(live) else None


@dataclass(frozen=True)
class Window:
    """What every rule reads: the samples (oldest first) and what is worked out from them once."""

    samples: Sequence[Sample]
    stale_after: float
    dt: float  # seconds from the first sample to the last
    live: list[int]  # the ranks LIVE in the last sample
    loads: dict[int, float]  # per live rank, its mean load over the window (_mean_loads)
    skew_floor: float  # the gap between the busiest and the idlest that makes their ratio count
    disp: _Dispatch | None  # the live dispatchers' counts over the window; None: none to count

    @classmethod
    def of(cls, samples: Sequence[Sample], stale_after: float = DEFAULT_STALE_AFTER) -> Window:
        if not samples:
            raise InvalidInputError("diagnose needs at least one sample")
        first, last = samples[0], samples[-1]
        dt = max(0.0, last.t - first.t)
        loads, floor = _mean_loads(samples)
        return cls(samples, stale_after, dt, [r["rank"] for r in last.ranks if r["status"] == _LIVE], loads, floor,
                   _dispatch_over(first, last, dt))

    @property
    def first(self) -> Sample:
        return self.samples[0]

    @property
    def last(self) -> Sample:
        return self.samples[-1]

    @property
    def over(self) -> str:
        """The window in evidence: "over 5.0 s"."""
        return f"over {self.dt:.1f} s"

    @property
    def load_ratio(self) -> float | None:
        return _ratio(list(self.loads.values()))

    @property
    def skewed(self) -> bool:
        return _one_sided(self.loads, self.load_ratio, self.skew_floor)

    @property
    def methods(self) -> set[str]:
        return self.disp.methods if self.disp else set()

    @property
    def requests(self) -> str:
        """The window's dispatched requests in evidence (with a dispatcher): "1190 requests over 5.0 s"."""
        assert self.disp is not None
        return f"{self.disp.counts['requests']} requests {self.over}"


# -- the rules: each one question of the checklist, answered with zero or more findings -------------


def check_dp_size(w: Window) -> list[Finding]:
    """dp_size really > 1, and more than one rank taking requests."""
    last, live, n = w.last, w.live, w.last.n_slots
    if n == 1:
        return [Finding("warning", "one slot: dp_size is 1", f"board {last.board!r} has 1 slot",
                        "with dp_size 1 there is no data-parallel controller: every request goes to the one rank "
                        "(checklist 1: is dp_size really > 1?)",
                        "start the server with --dp-size N (N > 1) and a board of N slots", "one_slot")]
    if len(live) > 1:
        return []
    others = "; ".join(f"rank {r['rank']} {r['status']}" for r in last.ranks if r["status"] != _LIVE)
    return [Finding("critical", f"only {len(live)} of {n} ranks live" + (f" (rank {live[0]})" if live else ""),
                    f"at the end of the window: {others}",
                    "the other ranks' schedulers do not publish (stopped, stalled or never started): a "
                    "health-aware or load-aware dispatcher sends every request to the live rank",
                    "restart the other ranks' schedulers (see the stale/torn finding for their pids) and check "
                    "their logs", "one_live_rank")]


def check_stale_or_torn(w: Window) -> list[Finding]:
    """The ranks that stopped publishing, each with its pid and whether it runs."""
    bad = sorted((r for r in w.last.ranks if r["status"] in (_STALE, _TORN)), key=lambda r: r["rank"])
    if not bad:
        return []
    parts, dead = [], False
    for r in bad:
        who = f"pid {r['pid']} {'running' if r['pid_alive'] else 'gone'}" if r["pid"] else "no writer"
        dead |= not r["pid_alive"] or r["status"] == _TORN
        if r["status"] == _STALE:
            parts.append(f"rank {r['rank']} stale, last publish {r['age_s']:.1f} s ago ({who})")
        else:
            parts.append(f"rank {r['rank']} torn ({who})")
    return [Finding("critical" if dead else "warning",
                    f"{len(bad)} rank{'s' if len(bad) > 1 else ''} stale or torn: "
                    f"{', '.join(str(r['rank']) for r in bad)}",
                    "; ".join(parts) + f" (stale after {w.stale_after:g} s)",
                    "a stale rank's scheduler stopped publishing: it died, or one step lasts longer than the "
                    "stale threshold (a long prefill); a torn rank's writer died or stalls in the middle of a "
                    "publish (SIGKILL)",
                    "restart the scheduler of a gone pid (the new writer takes the slot over); with long steps "
                    "raise the threshold (--stale-after, DPBOARD_STALE_AFTER)", "stale_or_torn")]


def check_record(w: Window) -> list[Finding]:
    """The dispatcher's own record: refused, missing, or no live dispatcher publishing in it."""
    last = w.last
    if last.record_refused is not None:
        return [Finding("warning", "the dispatch record is refused", last.record_refused,
                        "a file at the record's name that dpboard does not read (another user's, a link, one "
                        "others may write, damaged): the dispatcher runs without a record, and the method, "
                        "refresh rate and routed_dp_rank / bootstrap_room shares are not checked",
                        "remove the file once its deployment is stopped (or pass --trust-uid for a user you "
                        "trust); the next dispatcher makes a record of its own", "record_refused")]
    if last.dispatch is None:
        return [Finding("info", "no dispatch record", f"board {last.board!r} has no dispatch record",
                        "the dispatcher is not dpboard's (SGLang's or vLLM's own, without DPBOARD_METHOD), or an "
                        "older dpboard: the method, refresh rate and routed_dp_rank / bootstrap_room shares are "
                        "not checked",
                        "dispatch with dpboard (`dpboard controller --board`, or DPBOARD_METHOD in the plugins)",
                        "no_record")]
    if w.disp is not None:
        return []
    rows = ", ".join(f"pid {r.pid} ({'running' if r.alive else 'gone'}, last publish {r.age_s:.1f} s ago)"
                     for r in last.dispatch) or "no row claimed"
    return [Finding("warning", "the dispatcher does not publish", f"dispatch record rows: {rows}",
                    "the dispatcher that reads this board stopped, or never started dispatching",
                    "start the controller (or the server whose plugin dispatches); `dpboard clean` leaves the "
                    "record of a live dispatcher alone", "record_silent")]


def check_prefill_round_robin(w: Window) -> list[Finding]:
    """A PD prefill server switched to round robin: decode then waits for its KV forever."""
    return [Finding("critical", f"a PD prefill server dispatches by {row.method}",
                    f"dispatcher pid {row.pid}: method {row.method}, disaggregation mode prefill",
                    "a prefill rank must be the one its bootstrap_room maps to, the rank the decode side "
                    "waits on; round robin sends it elsewhere and the rendezvous fails",
                    f"use --load-balance-method {_PREFILL_PICK} on the prefill server (auto "
                    "picks it)", "prefill_round_robin")
            for row in (w.disp.rows if w.disp else [])
            if row.mode == "prefill" and _places(row.method, Delivery.ROUND_ROBIN)]


def check_pd_rendezvous(w: Window) -> list[Finding]:
    """The PD rendezvous: decode transfer queues that grow while prefill is idle."""
    first, last = w.first, w.last
    growing = []
    for r in last.ranks:
        if not (r["pd"] and r["pd"]["mode"] == "decode"):
            continue
        start = first.ranks[r["rank"]]["pd"]
        if not start:
            continue
        q0 = start["decode_transfer_queue_reqs"] + start["decode_prealloc_queue_reqs"]
        q1 = r["pd"]["decode_transfer_queue_reqs"] + r["pd"]["decode_prealloc_queue_reqs"]
        if q1 > q0 and q1 > 0:
            growing.append((r["rank"], q0, q1))
    if not growing:
        return []
    prefill = [r for r in last.ranks if r["pd"] and r["pd"]["mode"] == "prefill" and r["status"] == _LIVE]
    if any(r["num_running_reqs"] + r["num_waiting_reqs"] + r["pd"]["prefill_bootstrap_queue_reqs"]
           + r["pd"]["prefill_inflight_queue_reqs"] for r in prefill):
        return []
    where = (f"prefill {_ranks(r['rank'] for r in prefill)} idle (nothing running, waiting or in flight)"
             if prefill else "no prefill rank publishes on this board (check the prefill server's board)")
    grew = "; ".join(f"rank {k} {q0} -> {q1}" for k, q0, q1 in growing)
    return [Finding("critical", "decode waits for KV that never comes (PD rendezvous failure)",
                    f"decode transfer + prealloc queues grew {w.over}: {grew}; {where}",
                    "decode preallocated KV for requests whose prefill never sends it: the prefill server "
                    "dispatches to another rank than the request's bootstrap_room (switched to round robin), "
                    "or the rooms are missing or differ between the two sides",
                    f"prefill: --load-balance-method {_PREFILL_PICK} (or auto); the router must give "
                    "both sides the same bootstrap_room", "pd_rendezvous")]


def check_kv_saturation(w: Window) -> list[Finding]:
    """KV cache full on some live ranks while others have room."""
    if len(w.live) < 2:
        return []
    usage = {}
    for k in w.live:
        vals = [s.ranks[k]["num_used_tokens"] / s.ranks[k]["max_total_num_tokens"] for s in w.samples
                if s.ranks[k]["status"] == _LIVE and s.ranks[k]["max_total_num_tokens"] > 0]
        if vals:
            usage[k] = sum(vals) / len(vals)
    full = [k for k, u in usage.items() if u >= KV_FULL]
    if not full or not any(u < KV_ROOMY for u in usage.values()):
        return []
    return [Finding("warning", f"KV cache full on {_ranks(full)} only",
                    f"mean KV use {w.over}: " + ", ".join(f"rank {k} {usage[k]:.0%}" for k in sorted(usage)),
                    "requests that hold much KV pile up on some ranks: the method does not weigh tokens "
                    f"({_M.ROUND_ROBIN.value}, {_M.TOTAL_REQUESTS.value}), or routed_dp_rank / bootstrap_room "
                    "pin work there",
                    f"a token-aware method ({_M.TOTAL_TOKENS.value}, or dpboard's {_M.INFLIGHT_TOKENS.value}); "
                    "check the routed and room findings", "kv_saturation")]


def _pinned(w: Window) -> tuple[int, int] | None:
    """(rank, requests) where more than ``ROUTED_SHARE`` of the window's requests (10 at least) carried
    a routed_dp_rank for that one rank."""
    if w.disp is None or w.disp.counts["requests"] < 10:
        return None
    routed = w.disp.routed_per_rank
    top = max(range(w.last.n_slots), key=lambda k: routed[k])
    return (top, routed[top]) if routed[top] > ROUTED_SHARE * w.disp.counts["requests"] else None


def check_routed_one_rank(w: Window) -> list[Finding]:
    """Requests pinned to one rank by routed_dp_rank, which overrides every method."""
    pinned = _pinned(w)
    if pinned is None or w.disp is None:
        return []
    top, count = pinned
    total = w.disp.counts["requests"]
    return [Finding("critical", f"{_pct(count, total)} of requests routed to rank {top} by routed_dp_rank",
                    f"{count} of {w.requests} carried routed_dp_rank={top}; {_pct(w.disp.counts['routed'], total)} "
                    f"carried one at all",
                    "routed_dp_rank overrides every method (it is obeyed first): the client or gateway "
                    "pins the requests to one rank",
                    "drop routed_dp_rank from the requests, or have the gateway spread it over the ranks",
                    "routed_one_rank")]


def check_refresh_rate(w: Window) -> list[Finding]:
    """A load-aware dispatcher refreshing without SGLang's throttle, or above its own."""
    if w.disp is None:
        return []
    publish = _publish_rate(w.first, w.last, w.dt)
    found = []
    for row, per_s in w.disp.refresh_rates:
        if row.method in LOAD_UNAWARE or per_s <= 0:
            continue
        limit = 1 / row.refresh_interval if row.refresh_interval > 0 else None
        if limit is None and per_s > 1 / SGLANG_THROTTLE:
            title = f"refreshes {per_s:.0f}/s with no throttle"
            throttle = "refresh interval 0 (a refresh per dispatch)"
        elif limit is not None and per_s > 1.25 * limit + 1:
            title = f"refreshes {per_s:.0f}/s, above its throttle's {limit:.0f}/s"
            throttle = f"refresh interval {row.refresh_interval * 1e3:g} ms"
        else:
            continue
        pub = f"; the ranks publish {publish:.0f}/s each" if publish is not None else ""
        found.append(Finding(
            "warning", title,
            f"dispatcher pid {row.pid} ({row.method}): {per_s:.1f} refreshes/s {w.over}, {throttle}{pub}",
            "a load-aware method that refreshes at every dispatch resets its speculative +1s to the last "
            "snapshot, older than its picks, so a burst lands on the rank that looked least loaded",
            "restore SGLang's 20 ms throttle (--refresh-interval 0.02), or use an inflight_* method (its "
            "in-flight accounting keeps the picks across refreshes)", "refresh_rate"))
    return found


def check_rooms_uneven(w: Window) -> list[Finding]:
    """follow_bootstrap_room with rooms that do not spread uniformly modulo dp_size."""
    n = w.last.n_slots
    by_room = sorted(m for m in w.methods if _places(m, Delivery.ROOM))
    if w.disp is None or not by_room or n <= 1:
        return []
    unrouted = [w.disp.per_rank[k] - w.disp.routed_per_rank[k] for k in range(n)]
    if sum(unrouted) < 5 * n:
        return []
    room_ratio = _ratio(unrouted)
    if room_ratio is None or (room_ratio < SKEWED and min(unrouted) != 0):
        return []
    return [Finding("warning", "bootstrap rooms map unevenly onto the ranks",
                    f"requests per rank by room {w.over}: " + ", ".join(f"rank {k} {v}" for k, v in enumerate(unrouted))
                    + f" (max/mean {room_ratio:.2f}); "
                    f"{_pct(w.disp.counts['with_room'], w.disp.counts['requests'])} carried a room",
                    f"{by_room[0]} sends a request to bootstrap_room % dp_size: the router's rooms "
                    "are not uniform modulo dp_size (even rooms only, a constant, a counter stepping by "
                    "dp_size)",
                    "have the router draw rooms uniformly (random 63-bit, as SGLang's router does); keep "
                    f"{by_room[0]} on the prefill server", "rooms_uneven")]


def check_rejected(w: Window) -> list[Finding]:
    """Requests the dispatcher answered with an error instead of a rank."""
    rejected = w.disp.counts["rejected"] if w.disp else 0
    if not rejected or w.disp is None:
        return []
    by_room = sorted(m for m in w.methods if _places(m, Delivery.ROOM))
    if by_room:
        cause = (f"{by_room[0]} refuses a request without a bootstrap_room: it was sent straight "
                 "to the prefill server, not through the router")
        fix = "send PD requests through the router, which sets bootstrap_room"
    else:
        cause = ("requests the dispatcher cannot place: a routed_dp_rank outside the active ranks, no rank "
                 "available, or a malformed frame")
        fix = "see the dispatcher's log for each rejection (it names the request and why)"
    return [Finding("warning", f"{rejected} requests rejected",
                    f"{rejected} rejected beside {w.requests} "
                    f"({_pct(w.disp.counts['with_room'], w.disp.counts['requests'])} of the "
                    f"dispatched carried a bootstrap_room)", cause, fix, "rejected")]


def check_fallbacks(w: Window) -> list[Finding]:
    """Requests placed by a fallback pick: the method had no rank to give."""
    fallbacks = w.disp.counts["fallbacks"] if w.disp else 0
    if not fallbacks:
        return []
    return [Finding("warning", f"{fallbacks} requests placed by a fallback pick",
                    f"{fallbacks} fallbacks beside {w.requests}",
                    "the method had no rank to give, or its rank refused the request: every rank stale (one "
                    "long step stalled them past the threshold), or a scheduler's queue full or disconnected",
                    "check the stale ranks; with long steps raise the stale threshold; a full queue needs more "
                    "ranks or a larger --send-hwm", "fallbacks")]


def check_load_unaware_skew(w: Window) -> list[Finding]:
    """A method that reads no loads (``LOAD_UNAWARE``: round_robin, follow_bootstrap_room) while the
    loads are one-sided."""
    unaware = w.methods & set(LOAD_UNAWARE)
    if not (w.skewed and unaware):
        return []
    method = sorted(unaware)[0]
    if _places(method, Delivery.ROUND_ROBIN):
        cause = (f"{method} does not look at load: with prompts of very different lengths it piles the long "
                 "ones on some ranks")
        fix = (f"--load-balance-method {_M.TOTAL_TOKENS.value} (or dpboard's {_M.INFLIGHT_TOKENS.value}); but keep "
               f"{_PREFILL_PICK} on a PD prefill server")
    else:
        cause = f"{method} maps rooms to ranks and never looks at load"
        fix = ("keep the method on a PD prefill (the rendezvous needs it) and have the router spread its "
               "rooms; elsewhere use a load-aware method")
    return [Finding("warning", f"load-unaware {method} under skewed load",
                    f"mean total tokens {w.over}: " + ", ".join(f"rank {k} {v:.0f}" for k, v in w.loads.items())
                    + f" (max/mean {w.load_ratio:.2f})", cause, fix, "load_unaware_skew")]


def check_dispatch_vs_load(w: Window) -> list[Finding]:
    """The dispatch against the loads: one-sided while they are even, or even while they are not (a
    routed_dp_rank pinning is its own finding, and is not judged here again)."""
    sent = _dispatch_per_rank(w.first, w.last, w.disp, w.live)
    load_ratio = w.load_ratio
    if sent is None or load_ratio is None or _pinned(w) is not None:
        return []
    dispatch_ratio = _ratio(list(sent.values()))
    if dispatch_ratio is None:
        return []
    shares = ", ".join(f"rank {k} {_pct(v, sum(sent.values()))}" for k, v in sent.items())
    if dispatch_ratio >= SKEWED and load_ratio < EVEN:
        return [Finding("warning", "dispatch one-sided while the loads are even",
                        f"share of requests {w.over}: {shares} (max/mean {dispatch_ratio:.2f}); mean loads "
                        f"max/mean {load_ratio:.2f}",
                        "the loads on the board do not move with the requests: a scheduler publishes a constant "
                        "or another engine's counts, or the requests differ so much in size that a token-aware "
                        "method sends many short ones to a few ranks",
                        "compare each rank's num_received_reqs with its engine's own log; if the requests are "
                        "alike, check that each rank's plugin publishes its own engine", "dispatch_vs_load")]
    if dispatch_ratio < EVEN and w.skewed and not w.methods & set(LOAD_UNAWARE):
        return [Finding("warning", "dispatch even while the loads are one-sided",
                        f"share of requests {w.over}: {shares}; mean total tokens "
                        + ", ".join(f"rank {k} {v:.0f}" for k, v in w.loads.items())
                        + f" (max/mean {load_ratio:.2f})",
                        "requests go out evenly but the work does not: the method counts requests, not tokens "
                        f"({_M.ROUND_ROBIN.value}, {_M.TOTAL_REQUESTS.value}), or it does not read the loads "
                        "(a stale board read)",
                        f"a token-aware method ({_M.TOTAL_TOKENS.value}, {_M.INFLIGHT_TOKENS.value}) reading "
                        "this board",
                        "dispatch_vs_load")]
    return []


def check_inflight_stuck(w: Window) -> list[Finding]:
    """The in-flight count of vLLM's API servers (their sent record): requests never received."""
    stuck = _stuck_in_flight(w.samples)
    if not stuck or w.dt < STUCK_WINDOW:
        return []
    return [Finding("warning", f"requests sent and never received on {_ranks(k for k, _ in stuck)}",
                    f"in flight (sent by the API servers less received by the engine) {w.over}, the engine's "
                    f"received count unchanged: " + ", ".join(f"rank {k} {n}" for k, n in stuck),
                    "the API servers count these requests as in flight to the engine, which never counted them: "
                    "lost on the way (an engine restarted while they were queued), or an engine that does not "
                    "count what it receives (its dpboard plugin is off); load-aware dispatch then sees the "
                    "rank as busier than it is",
                    "check the engine's log for requests it dropped and that its plugin is on; the count goes "
                    "back to 0 when the API servers restart (their sent rows begin again)", "inflight_stuck")]


def check_idle(w: Window) -> list[Finding]:
    """No traffic in the window: the dispatch findings had nothing to judge."""
    if w.disp is None or w.disp.counts["requests"] != 0:
        return []
    return [Finding("info", "no requests dispatched", f"0 requests {w.over}",
                    "nothing was sent during the window: the dispatch findings need traffic",
                    "run doctor while the server serves, or with a longer --window", "idle")]


Rule = Callable[[Window], list[Finding]]

# The checklist in the order its findings are listed within one severity.
RULES: tuple[Rule, ...] = (
    check_dp_size, check_stale_or_torn, check_record, check_prefill_round_robin, check_pd_rendezvous,
    check_kv_saturation, check_routed_one_rank, check_refresh_rate, check_rooms_uneven, check_rejected,
    check_fallbacks, check_load_unaware_skew, check_dispatch_vs_load, check_inflight_stuck, check_idle,
)


def diagnose(samples: Sequence[Sample], *, stale_after: float = DEFAULT_STALE_AFTER) -> list[Finding]:
    """Findings over ``samples`` (oldest first, at least one), most serious first."""
    window = Window.of(samples, stale_after)
    found = [finding for rule in RULES for finding in rule(window)]
    found.sort(key=lambda f: SEVERITIES.index(f.severity))
    return found


def summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """What the window saw, for the report's head: ranks, the dispatchers and their rates."""
    first, last = samples[0], samples[-1]
    dt = max(0.0, last.t - first.t)
    counts = {s: 0 for s in (x.label for x in SlotStatus)}
    for r in last.ranks:
        counts[r["status"]] += 1
    out: dict[str, Any] = {"board": last.board, "n_slots": last.n_slots, "window_s": round(dt, 3),
                           "samples": len(samples), "status_counts": counts, "dispatchers": []}
    disp = _dispatch_over(first, last, dt)
    for row in last.dispatch or []:
        entry = {"pid": row.pid, "alive": row.alive, "method": row.method, "mode": row.mode,
                 "refresh_interval_s": row.refresh_interval}
        rate = next((r for d, r in (disp.refresh_rates if disp else []) if d is row), None)
        entry["refreshes_per_s"] = rate
        out["dispatchers"].append(entry)
    if last.in_flight is not None:
        out["in_flight"] = last.in_flight
    if disp is not None and dt > 0:
        total = disp.counts["requests"]
        out["requests_per_s"] = total / dt
        out["routed_share"] = disp.counts["routed"] / total if total else None
        out["room_share"] = disp.counts["with_room"] / total if total else None
        out["per_rank"] = disp.per_rank
    return out


def healthy(findings: Iterable[Finding]) -> bool:
    """No critical or warning finding (an info note is not a fault)."""
    return not any(f.severity != "info" for f in findings)


# -- a rolling window, for top and serve --------------------------------------------------------------


class DoctorWatch:
    """Samples a board at most every ``every`` seconds and keeps ``window`` seconds of them.

    A sample reads every slot into Python values; past ``MAX_WATCH_SLOTS`` slots that would cost a
    live view more than its frame, so such a board is left to ``dpboard doctor`` (``covers``)."""

    def __init__(self, window: float = 10.0, every: float = 0.5, stale_after: float = DEFAULT_STALE_AFTER,
                 trust_uids: tuple[int, ...] = ()) -> None:
        self.window = window
        self.every = every
        self.stale_after = stale_after
        self.trust_uids = trust_uids
        self.samples: deque[Sample] = deque()
        self._reader_of: tuple[Board, BoardReader] | None = None
        self._board_id: tuple[str, int] | None = None
        self._error: str | None = None

    def observe(self, board: Board | None, reader: BoardReader | None) -> None:
        if board is None or reader is None:
            self.samples.clear()
            return
        now = time.monotonic()
        if self.samples and now - self.samples[-1].t < self.every:
            return
        if self._board_id != (board.name, board.generation):
            self.samples.clear()  # another incarnation: its counters began again
            self._board_id = (board.name, board.generation)
        try:
            self.samples.append(take_sample(board, reader, trust_uids=self.trust_uids))
            self._error = None
        except DpboardError as e:
            self._error = str(e)
            return
        while len(self.samples) > 2 and now - self.samples[0].t > self.window:
            self.samples.popleft()

    @staticmethod
    def covers(board: Board | None) -> bool:
        return board is not None and board.n_slots <= MAX_WATCH_SLOTS

    def observe_watch(self, watch: Any) -> None:
        """``observe`` the board a ``BoardWatch`` holds now (after its own sample followed it)."""
        board = watch.board
        if not self.covers(board):
            self._reader_of = None
            self.observe(None, None)
            return
        if self._reader_of is None or self._reader_of[0] is not board:
            self._reader_of = (board, board.reader(stale_after=self.stale_after))
        self.observe(board, self._reader_of[1])

    def findings(self) -> list[Finding]:
        found = diagnose(list(self.samples), stale_after=self.stale_after) if self.samples else []
        if self._error is not None:  # the board could not be sampled at all: said, never fatal to the view
            found.insert(0, Finding("warning", "the board cannot be sampled", shown(self._error),
                                    "dpboard refuses what it would read", "see the evidence", "sample_failed"))
        return found

    def document(self) -> dict[str, Any]:
        """``GET /v1/doctor``'s body."""
        found = self.findings()
        span = self.samples[-1].t - self.samples[0].t if self.samples else 0.0
        return {"healthy": healthy(found), "window_s": round(span, 3), "findings": [f.as_dict() for f in found]}


def header_line(document: dict[str, Any]) -> str:
    """One line for ``top``'s header, from a ``DoctorWatch.document()``: how many findings, the worst.
    A window shorter than ``HEALTHY_WINDOW`` (``top --once``'s two reads) shows what a look finds,
    not a verdict: what goes wrong over time (rates, queues that grow) needs longer to show."""
    faults = [f for f in document["findings"] if f["severity"] != "info"]
    if not faults and document["window_s"] < HEALTHY_WINDOW:
        return (f"doctor: nothing found in a {document['window_s']:.1f} s look "
                f"(dpboard doctor watches {DEFAULT_WINDOW:g} s)")
    if not faults:
        return f"doctor: healthy over {document['window_s']:.0f} s"
    worst = faults[0]
    return (f"doctor: {len(faults)} finding{'s' if len(faults) > 1 else ''} — worst: [{worst['severity']}] "
            f"{worst['title']} (dpboard doctor for the evidence)")


# -- the command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", metavar="BOARD", help="the board (default: the only board of this user here)")
    p.add_argument("--window", type=seconds(), default=DEFAULT_WINDOW,
                   help=f"seconds to watch the board and its dispatcher (default {DEFAULT_WINDOW:g})")
    p.add_argument("--samples", type=count(2, 1000), default=SAMPLES,
                   help=f"reads over the window, its start and end included (default {SAMPLES})")
    p.add_argument("--stale-after", type=stale_after, default=DEFAULT_STALE_AFTER,
                   help=f"seconds before a slot is stale (default {DEFAULT_STALE_AFTER:g})")
    p.add_argument("--trust-uid", type=count(0, 2**32 - 2), action="append", default=[], metavar="UID",
                   help="also read a board and record this user created (e.g. 0 for root); repeatable")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document")


def _only_board() -> str:
    import os

    mine = [b for b in list_boards() if b.header is not None and b.owner_uid == os.geteuid()]
    if len(mine) == 1:
        return mine[0].name
    if not mine:
        raise NotFoundError("no board of this user on this machine: name one (`dpboard ls` lists them)")
    raise InvalidInputError(f"{len(mine)} boards here ({', '.join(b.name for b in mine)}): name the one to check")


def collect(board: Board, reader: BoardReader, window: float, n: int, trust_uids: tuple[int, ...],
            progress: Callable[[float, int], None] | None = None) -> list[Sample]:
    """``n`` samples evenly over ``window`` seconds (bounded: ``n`` reads and ``window`` of sleep);
    ``progress(seconds, samples)`` is told how far it is, at least every ``PROGRESS_EVERY`` s."""
    start = time.monotonic()
    samples: list[Sample] = []
    for i in range(n):
        wake = start + window * i / (n - 1)
        while (delay := wake - time.monotonic()) > 0:
            time.sleep(min(delay, PROGRESS_EVERY))
            if progress is not None:
                progress(time.monotonic() - start, len(samples))
        samples.append(take_sample(board, reader, trust_uids=trust_uids))
    return samples


class Progress:
    """What ``dpboard doctor`` shows on stderr while it watches: on a terminal a count rewritten in
    place and erased at the end, elsewhere one line when the window starts."""

    def __init__(self, name: str, window: float, n: int, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.name, self.window, self.n = name, window, n
        self.stream.write(f"dpboard doctor: watching board {name} for {window:g} s ({n} samples) ..."
                          + ("" if self.live else "\n"))
        self.stream.flush()

    def __call__(self, seconds: float, samples: int) -> None:
        if self.live:
            self.stream.write(f"\r\x1b[Kdpboard doctor: watching board {self.name}: {min(seconds, self.window):.0f} "
                              f"of {self.window:g} s, {samples} of {self.n} samples")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def render(report: dict[str, Any], findings: Sequence[Finding]) -> str:
    lines = []
    c = report["status_counts"]
    lines.append(f"dpboard doctor: board {report['board']}, {report['n_slots']} slots ({c['live']} live, "
                 f"{c['stale']} stale, {c['torn']} torn, {c['empty']} empty), over {report['window_s']:.1f} s")
    for d in report["dispatchers"]:
        refresh = d["refreshes_per_s"]
        throttle = f"{d['refresh_interval_s'] * 1e3:g} ms" if d["refresh_interval_s"] else "none"
        reads = ("reads no loads" if d["method"] in LOAD_UNAWARE else
                 f"refreshes {'-' if refresh is None else f'{refresh:.1f}'}/s (throttle {throttle})")
        lines.append(f"dispatcher pid {d['pid']}{'' if d['alive'] else ' (gone)'}: method {d['method']}, "
                     f"disaggregation {d['mode']}, {reads}")
    if "requests_per_s" in report:
        share = lambda v: "-" if v is None else f"{100 * v:.0f} %"  # noqa: E731
        lines.append(f"requests {report['requests_per_s']:.1f}/s, per rank {report['per_rank']}, "
                     f"with routed_dp_rank {share(report['routed_share'])}, with bootstrap_room "
                     f"{share(report['room_share'])}")
    if "in_flight" in report:
        flying = report["in_flight"]
        busy = [(k, n) for k, n in enumerate(flying) if n]
        more = f", {len(busy) - 16} more ranks" if len(busy) > 16 else ""
        lines.append(f"in flight (sent by the API servers, not yet received): {sum(flying)}"
                     + (": " + ", ".join(f"rank {k} {n}" for k, n in busy[:16]) + more + ", the others 0"
                        if busy else " on every rank"))
    faults = [f for f in findings if f.severity != "info"]
    lines.append("")
    notes = len(findings) - len(faults)
    lines.append(("healthy: no findings" + (f" ({notes} note{'s' if notes > 1 else ''})" if notes else ""))
                 if not faults else f"{len(faults)} finding{'s' if len(faults) > 1 else ''}, most serious first:")
    for f in findings:
        lines.append("")
        lines.append(f"[{f.severity}] {f.title}")
        lines.append(f"  evidence: {f.evidence}")
        lines.append(f"  cause:    {f.cause}")
        lines.append(f"  fix:      {f.fix}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    name = args.name or _only_board()
    trust = tuple(args.trust_uid)
    with Board.attach(name, trust_uids=trust) as board:
        reader = board.reader(stale_after=args.stale_after, arrays=False)
        progress = Progress(name, args.window, args.samples)
        try:
            samples = collect(board, reader, args.window, args.samples, trust, progress)
        finally:
            progress.close()
    findings = diagnose(samples, stale_after=args.stale_after)
    report = summary(samples)
    ok = healthy(findings)
    if args.json:
        print(json.dumps({**report, "healthy": ok, "findings": [f.as_dict() for f in findings]}))
    else:
        print(render(report, findings))
    sys.stdout.flush()
    return 0 if ok else 1
