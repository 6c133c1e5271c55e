"""``dpboard sim``: a deterministic discrete-event simulation that compares dispatch methods.

The simulator drives the real ``dpboard.controller.Dispatcher`` (the code users run) against a
model of DP ranks (``dpboard.sim.model``) on a request trace (``dpboard.sim.trace``), one run per
method on the same trace, and reports time to first token, queueing delay, load imbalance over time
and how often a rank idles while another queues (``dpboard.sim.report``).

The pipeline it models, per request:

    arrival at the controller --dispatch (policy)--> send_delay --> rank's waiting queue
    rank steps (prefill / decode) --publish per cadence--> visibility delay --> controller's reads

Publish cadences: ``step`` (every scheduler step), ``sglang`` (every ``publish_every`` decode steps,
forced on prefill and while idle, as SGLang does with 15), ``period`` (every ``publish_period``
seconds, whatever the rank does). Idle ranks keep publishing every ``idle_publish`` seconds under
the first two, as SGLang's idle loop does.

Everything runs on a simulated clock: events sit in a heap keyed (time, sequence number), the
trace comes from a seeded NumPy generator, and no wall clock decides anything (it only times the run
for the report), so a seed gives one result.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.sim.model import IDLE, PREFILL, RankConfig, RankModel, SimRequest
from dpboard.sim.policy import Policy, SimBoard, make_policy, parse_method_spec
from dpboard.sim.trace import Trace

CADENCES = ("step", "sglang", "period")
SEED_METHODS = ("round_robin", "total_requests", "total_tokens")

# Event kinds, in the heap as (time, seq, kind, a, b).
_ARRIVE = 0
_RECEIVE = 1
_STEP_END = 2
_PUBLISH_TICK = 3
_IDLE_BEAT = 4
_SAMPLE = 5
_POLICY_TICK = 6


@dataclass(frozen=True)
class PublishConfig:
    """When ranks publish their snapshot, and how long until the controller can see it."""

    cadence: str = "sglang"
    every_decode_steps: int = 15  # sglang cadence: one publish per this many decode steps
    period_s: float = 0.01  # period cadence
    idle_publish_s: float = 0.01  # step and sglang cadences: an idle rank republishes this often
    visibility_delay_s: float = 0.0

    def validate(self) -> PublishConfig:
        if self.cadence not in CADENCES:
            raise InvalidInputError(f"unknown publish cadence {self.cadence!r}: use one of {', '.join(CADENCES)}")
        if self.every_decode_steps < 1:
            raise InvalidInputError(f"publish_every must be >= 1 decode step, got {self.every_decode_steps}")
        if self.period_s <= 0 or self.idle_publish_s <= 0:
            raise InvalidInputError("publish period and idle publish period must be > 0 seconds")
        if self.visibility_delay_s < 0:
            raise InvalidInputError(f"visibility delay must be >= 0 seconds, got {self.visibility_delay_s}")
        return self


@dataclass(frozen=True)
class SimConfig:
    """Everything about a run except the trace and the method."""

    n_ranks: int = 8
    rank: RankConfig = field(default_factory=RankConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    send_delay_s: float = 0.0005  # controller -> rank transit (ZMQ PUSH, scheduler recv)
    refresh_interval_s: float = 0.02  # the Dispatcher's budget throttle, unless a method overrides it
    sample_period_s: float = 0.05  # metrics over time
    max_sim_s: float = 3600.0  # bound: a run that has not drained by then is an error, not a hang

    def validate(self) -> SimConfig:
        if self.n_ranks < 1:
            raise InvalidInputError(f"--ranks must be >= 1, got {self.n_ranks}")
        if self.send_delay_s < 0 or self.refresh_interval_s < 0:
            raise InvalidInputError("send delay and refresh interval must be >= 0 seconds")
        if self.sample_period_s <= 0:
            raise InvalidInputError(f"sample period must be > 0 seconds, got {self.sample_period_s}")
        self.rank.validate()
        self.publish.validate()
        return self


@dataclass
class RunResult:
    """One method's run: per-request records and per-sample series."""

    method: str
    requests: list[SimRequest]
    sample_t: np.ndarray  # sample times, seconds
    sample_tokens: np.ndarray  # [samples, ranks] num_total_tokens (true, not as published)
    sample_idle_while_queued: np.ndarray  # bool per sample
    publishes: int
    board_reads: int
    retractions: int
    end_s: float
    wall_s: float


SIM_OPTIONS = ("cadence", "publish_every")


def split_sim_options(spec: str, config: SimConfig) -> tuple[str, SimConfig]:
    """Take the simulator's own options out of a method spec and apply them to this run's config.

    ``total_tokens:cadence=sglang`` runs total_tokens with SGLang's publish cadence whatever the
    command line says, so one table can compare methods each with the cadence its system ships with.
    """
    name, options = parse_method_spec(spec)
    sim_options = {k: options.pop(k) for k in SIM_OPTIONS if k in options}
    if not sim_options:
        return spec, config
    publish = config.publish
    if "cadence" in sim_options:
        publish = dataclasses.replace(publish, cadence=str(sim_options["cadence"]))
    if "publish_every" in sim_options:
        publish = dataclasses.replace(publish, every_decode_steps=int(sim_options["publish_every"]))
    rest = ",".join(f"{k}={v}" for k, v in options.items())
    return (f"{name}:{rest}" if rest else name), dataclasses.replace(config, publish=publish)


class Simulation:
    """One method on one trace. ``run()`` returns a ``RunResult``; a Simulation runs once."""

    def __init__(self, trace: Trace, method: str, config: SimConfig):
        policy_spec, config = split_sim_options(method, config)
        self.config = config.validate()
        if trace.n_ranks != config.n_ranks:
            raise InvalidInputError(
                f"trace was drawn for {trace.n_ranks} ranks but the simulation has {config.n_ranks}"
            )
        longest = int((trace.prompt_len + trace.output_len).max()) if len(trace) else 0
        if longest + 1 > config.rank.kv_capacity:
            raise InvalidInputError(
                f"a request of {longest} tokens (prompt + output) cannot fit a rank's KV capacity of "
                f"{config.rank.kv_capacity}: raise --kv-capacity or lower the trace's prompt_max/output_max"
            )
        self.trace = trace
        self.now = 0.0
        self.ranks = [RankModel(r, config.rank) for r in range(config.n_ranks)]
        self.board = SimBoard(config.n_ranks, self.clock, config.publish.visibility_delay_s)
        self.policy: Policy = make_policy(
            policy_spec,
            label=method,
            n_ranks=config.n_ranks,
            board=self.board,
            clock=self.clock,
            refresh_interval_s=config.refresh_interval_s,
        )
        self.method = method
        self.requests = [
            SimRequest(i, float(a), int(p), int(o), bool(b))
            for i, (a, p, o, b) in enumerate(
                zip(trace.arrival_s, trace.prompt_len, trace.output_len, trace.is_burst, strict=True)
            )
        ]
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._publish_seq = [0] * config.n_ranks
        self._decode_since_publish = [0] * config.n_ranks
        self._idle_epoch = [0] * config.n_ranks
        self._finished = 0
        self._ran = False

    def clock(self) -> float:
        return self.now

    # -- plumbing ------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _publish(self, r: int) -> None:
        self._publish_seq[r] += 1
        self._decode_since_publish[r] = 0
        self.board.publish(r, self.ranks[r].snapshot(self.now, self._publish_seq[r]), self.now)

    def _start_step(self, r: int) -> None:
        rank = self.ranks[r]
        duration = rank.begin_step(self.now)
        cadence = self.config.publish.cadence
        if duration is None:
            if cadence != "period":  # SGLang publishes on every idle loop; beats keep it fresh
                self._publish(r)
                self._idle_epoch[r] += 1
                self._push(self.now + self.config.publish.idle_publish_s, _IDLE_BEAT, r, self._idle_epoch[r])
            return
        if cadence == "step":
            self._publish(r)
        elif cadence == "sglang":
            if rank.state == PREFILL:
                self._publish(r)
            else:
                self._decode_since_publish[r] += 1
                if self._decode_since_publish[r] >= self.config.publish.every_decode_steps:
                    self._publish(r)
        rank.busy_s += duration
        self._push(self.now + duration, _STEP_END, r)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> RunResult:
        if self._ran:
            raise RuntimeError("a Simulation runs once; make a new one for another run")
        self._ran = True
        wall0 = time.perf_counter()
        cfg = self.config
        n_total = len(self.requests)
        for req in self.requests:
            self._push(req.arrival_s, _ARRIVE, req.rid)
        for r in range(cfg.n_ranks):
            self._publish(r)  # every rank announces itself (empty) at start, as a live scheduler would
            if cfg.publish.cadence == "period":
                self._push(cfg.publish.period_s * (r + 1) / cfg.n_ranks, _PUBLISH_TICK, r)
            else:
                self._idle_epoch[r] += 1
                self._push(cfg.publish.idle_publish_s, _IDLE_BEAT, r, self._idle_epoch[r])
        self._push(0.0, _SAMPLE)
        if self.policy.tick_period_s > 0:
            self._push(0.0, _POLICY_TICK)

        sample_t: list[float] = []
        sample_tokens: list[list[int]] = []
        sample_iwq: list[bool] = []
        heap = self._heap
        ranks = self.ranks
        n_ranks = cfg.n_ranks
        while self._finished < n_total:
            if not heap:
                raise RuntimeError(
                    f"simulation of {self.method!r} ran out of events with requests unfinished"
                )
            t, _, kind, a, b = heapq.heappop(heap)
            if t > cfg.max_sim_s:
                raise RuntimeError(
                    f"simulation of {self.method!r} did not drain within {cfg.max_sim_s} simulated seconds "
                    f"({self._finished}/{n_total} requests finished): the trace overloads the ranks"
                )
            self.now = t
            if kind == _STEP_END:
                self._finished += ranks[a].end_step(t)
                self._start_step(a)
            elif kind == _ARRIVE:
                req = self.requests[a]
                rank = self.policy.dispatch(req)
                if not 0 <= rank < n_ranks:
                    raise RuntimeError(f"method {self.method!r} picked rank {rank} of {n_ranks}")
                self._push(t + cfg.send_delay_s, _RECEIVE, a, rank)
            elif kind == _RECEIVE:
                rank_model = ranks[b]
                rank_model.receive(self.requests[a], t)
                if rank_model.state == IDLE:
                    self._idle_epoch[b] += 1  # cancels its idle beat
                    self._start_step(b)
            elif kind == _IDLE_BEAT:
                if ranks[a].state == IDLE and b == self._idle_epoch[a]:
                    self._publish(a)
                    self._push(t + cfg.publish.idle_publish_s, _IDLE_BEAT, a, b)
            elif kind == _PUBLISH_TICK:
                self._publish(a)
                self._push(t + cfg.publish.period_s, _PUBLISH_TICK, a)
            elif kind == _SAMPLE:
                tokens = [rk.total_tokens for rk in ranks]
                any_idle = False
                any_queued = False
                for rk in ranks:
                    if rk.state == IDLE:
                        any_idle = True
                    elif rk.waiting:
                        any_queued = True
                sample_t.append(t)
                sample_tokens.append(tokens)
                sample_iwq.append(any_idle and any_queued)
                self._push(t + cfg.sample_period_s, _SAMPLE)
            elif kind == _POLICY_TICK:
                self.policy.on_tick(t, ranks)
                self._push(t + self.policy.tick_period_s, _POLICY_TICK)
        return RunResult(
            method=self.method,
            requests=self.requests,
            sample_t=np.asarray(sample_t, dtype=np.float64),
            sample_tokens=np.asarray(sample_tokens, dtype=np.int64).reshape(len(sample_t), n_ranks),
            sample_idle_while_queued=np.asarray(sample_iwq, dtype=bool),
            publishes=self.board.publishes,
            board_reads=self.board.reads,
            retractions=sum(rk.retracted for rk in ranks),
            end_s=self.now,
            wall_s=time.perf_counter() - wall0,
        )


def simulate(trace: Trace, methods: list[str], config: SimConfig) -> list[RunResult]:
    """Run every method on the same trace, one after another, each from a fresh cluster."""
    return [Simulation(trace, m, config).run() for m in methods]


def default_methods() -> list[str]:
    """The seed methods, vLLM's score and every improved method the controller offers."""
    from dpboard.sim.policy import VLLM, controller_methods

    offered = controller_methods()
    improved = [m for m in offered if m not in (*SEED_METHODS, "auto", "follow_bootstrap_room")]
    seeds = [m for m in SEED_METHODS if m in offered] if offered else []
    return [*seeds, VLLM, *improved]


def config_dict(config: SimConfig) -> dict[str, Any]:
    d = asdict(config)
    d["max_sim_s"] = config.max_sim_s if math.isfinite(config.max_sim_s) else None
    return d
