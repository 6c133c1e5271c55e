"""``dpboard sim``: a deterministic discrete-event simulation that compares dispatch methods.

The simulator drives the real ``dpboard.controller.Dispatcher`` (the code users run), and the
peers' routers (``dpboard.sim.peers``), against a model of DP ranks with prefix caches
(``dpboard.sim.model``) on a request trace (``dpboard.sim.trace``, ``dpboard.sim.tracefile``), one
run per method on the same trace. ``dpboard.sim.report`` turns the ``RunResult`` into time to first
token, queueing delay, load imbalance over time, prefix-cache hits and how often a rank idles while
another queues.

The pipeline it models, per request:

    arrival at the controller --dispatch (policy)--> send_delay --> rank's waiting queue
    rank steps (prefill / decode) --publish per cadence--> visibility delay --> controller's reads
    rank's prefix cache --KV events--> visibility delay --> a router that subscribes to them

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
import functools
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.sim.methods import VLLM_BOARD, make_policy, parse_method_spec
from dpboard.sim.model import (
    DECODE,
    IDLE,
    PREFILL,
    QUEUED_PREFILL_REPORTS,
    SGLANG_REPORT,
    RankConfig,
    RankModel,
    SimRequest,
)
from dpboard.sim.policy import Policy, SimBoard
from dpboard.sim.prefill_delayer import PrefillDelayer
from dpboard.sim.stepping import LockstepCost, RankGroup
from dpboard.sim.trace import Trace
from dpboard.sim.transfer import PdConfig

CADENCES = ("step", "sglang", "period")

# Event kinds, in the heap as (time, seq, kind, a, b); the index of their handler in Simulation.
_ARRIVE = 0
_RECEIVE = 1
_STEP_END = 2
_PUBLISH_TICK = 3
_IDLE_BEAT = 4
_SAMPLE = 5
_POLICY_TICK = 6
_KV_EVENT = 7
_WAVE = 8
BASE_EVENT_KINDS = 9  # a simulation that adds kinds (dpboard.sim.pd) numbers them from here
# SGLang's decode log interval (--decode-log-interval): its gen_throughput is the tokens decoded over
# the last this many decode steps, over their time
DECODE_LOG_INTERVAL = 40


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
    drain_limit_s: float = 3600.0  # bound: a run not drained this long after its last arrival is an error
    queued_prefill: str = SGLANG_REPORT  # how ranks report their queued prefill: SGLang's figure, or "exact"
    lockstep: LockstepCost | None = None  # DP attention: all ranks step together (None: independent ranks)
    # A request's path outside the schedulers (HTTP server, tokenizer, DP controller, detokenizer,
    # the stream back): a fixed time per request, added to its first token and its end. Arrivals are
    # not shifted: the same delay for every request moves no dispatch decision.
    frontend_s: float = 0.0
    slo_ttft_s: float = 1.0  # goodput: a request meets its SLOs with TTFT and TPOT at most these
    slo_tpot_s: float = 0.1
    pd: PdConfig | None = None  # PD disaggregation: prefill and decode pools (n_ranks is their sum)
    prefill_delayer: bool = False  # SGLang's --enable-prefill-delayer, its defaults (lockstep groups that prefill)
    # SGLang's --prefill-delayer-queue-min-ratio: the delayer's queue trigger (None: off, SGLang's default)
    prefill_delayer_queue_min_ratio: float | None = None
    # SGLang's overlap scheduler: a request received during a step is admitted a step later. None:
    # on under DP attention (SGLang's default), off for independent ranks (the earlier cells' model)
    overlap_schedule: bool | None = None

    def lockstep_section(self, group_size: int) -> tuple[int, int] | None:
        """What the ranks of a lockstep group of ``group_size`` publish as their lockstep detail."""
        if self.lockstep is None:
            return None
        return group_size, self.rank.prefill_step_tokens

    def delayer(self, n_ranks: int) -> PrefillDelayer | None:
        """The prefill delayer of a lockstep group of ``n_ranks`` as this run configures it (None: off)."""
        if not self.prefill_delayer:
            return None
        return PrefillDelayer(n_ranks, queue_min_ratio=self.prefill_delayer_queue_min_ratio)

    @property
    def overlap(self) -> bool:
        return self.lockstep is not None if self.overlap_schedule is None else self.overlap_schedule

    def validate(self) -> SimConfig:
        if self.n_ranks < 1:
            raise InvalidInputError(f"--ranks must be >= 1, got {self.n_ranks}")
        if self.send_delay_s < 0 or self.refresh_interval_s < 0:
            raise InvalidInputError("send delay and refresh interval must be >= 0 seconds")
        if not (math.isfinite(self.frontend_s) and self.frontend_s >= 0):
            raise InvalidInputError(f"front-end time must be >= 0 seconds, got {self.frontend_s}")
        if self.sample_period_s <= 0:
            raise InvalidInputError(f"sample period must be > 0 seconds, got {self.sample_period_s}")
        if not self.drain_limit_s > 0:
            raise InvalidInputError(f"drain limit must be > 0 seconds, got {self.drain_limit_s}")
        if self.queued_prefill not in QUEUED_PREFILL_REPORTS:
            raise InvalidInputError(
                f"--queued-prefill {self.queued_prefill!r}: use one of {', '.join(QUEUED_PREFILL_REPORTS)}"
            )
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise InvalidInputError(
                f"--slo-ttft-ms and --slo-tpot-ms must be > 0, got {self.slo_ttft_s * 1e3:g} and {self.slo_tpot_s * 1e3:g}"
            )
        self.rank.validate()
        self.publish.validate()
        if self.lockstep is not None:
            self.lockstep.validate(self.rank)
        if self.prefill_delayer and self.lockstep is None:
            raise InvalidInputError(
                "--prefill-delayer holds prefill back so that ranks in lockstep prefill together: it needs --dp-attention"
            )
        ratio = self.prefill_delayer_queue_min_ratio
        if ratio is not None:
            if not self.prefill_delayer:
                raise InvalidInputError(
                    "--prefill-delayer-queue-min-ratio is a trigger of the prefill delayer: add --prefill-delayer"
                )
            if not (math.isfinite(ratio) and ratio > 0):
                raise InvalidInputError(
                    f"--prefill-delayer-queue-min-ratio must be > 0 (SGLang's typical 0.1 to 0.5), got {ratio}"
                )
        if self.pd is not None:
            self.pd.validate()
            if self.pd.n_ranks != self.n_ranks:
                raise InvalidInputError(
                    f"--pd {self.pd.n_prefill}:{self.pd.n_decode} is {self.pd.n_ranks} ranks, the run has {self.n_ranks}"
                )
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
    evicted_tokens: int  # prefix-cache tokens evicted to make room
    end_s: float
    wall_s: float
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.1
    lockstep: bool = False
    group_steps: int = 0  # steps run, over all groups
    rank_steps: int = 0  # rank-steps in those steps (a lockstep step of n ranks counts n)
    idle_rank_steps: int = 0  # rank-steps spent in an idle batch while another rank of the group worked
    extend_steps: int = 0  # lockstep steps in which some rank extended
    eager_decode_rank_steps: int = 0  # decode rank-steps run without their CUDA graph (an extend step)
    pd: dict[str, Any] | None = None  # PD: both sides' methods and the transfer stage's record
    sample_decoded: np.ndarray | None = None  # per sample: output tokens the sampled ranks' decode steps gave so far
    delayer_held_passes: int = 0  # passes in which the prefill delayer held prefill back
    delayer_timeouts: int = 0  # waits the delayer ended because max_delay_passes ran out
    stalled_decodes: int = 0  # request-steps without a token because the request's rank prefilled
    held_s: np.ndarray | None = None  # per request, seconds the controller held it (a holding method)


SIM_OPTIONS = ("cadence", "publish_every", "prefill_delayer")


def split_sim_options(spec: str, config: SimConfig) -> tuple[str, SimConfig]:
    """Take the simulator's own options out of a method spec and apply them to this run's config.

    ``total_tokens:cadence=sglang`` runs total_tokens with SGLang's publish cadence whatever the
    command line says, so one table can compare methods each with the cadence its system ships with;
    ``prefill_delayer=on`` runs that method's group with SGLang's prefill delayer.
    """
    name, options = parse_method_spec(spec)
    sim_options = {k: options.pop(k) for k in SIM_OPTIONS if k in options}
    if name == VLLM_BOARD:
        sim_options.setdefault("cadence", "step")  # the engines publish from their schedulers every step
    if not sim_options:
        return spec, config
    if "prefill_delayer" in sim_options:
        value = sim_options.pop("prefill_delayer")
        if not isinstance(value, bool):
            raise InvalidInputError(f"prefill_delayer={value!r} in {spec!r}: use on or off")
        # off for this method takes its queue trigger with it
        ratio = config.prefill_delayer_queue_min_ratio if value else None
        config = dataclasses.replace(config, prefill_delayer=value, prefill_delayer_queue_min_ratio=ratio)
    publish = config.publish
    if "cadence" in sim_options:
        publish = dataclasses.replace(publish, cadence=str(sim_options["cadence"]))
    if "publish_every" in sim_options:
        publish = dataclasses.replace(publish, every_decode_steps=int(sim_options["publish_every"]))
    rest = ",".join(f"{k}={v}" for k, v in options.items())
    return (f"{name}:{rest}" if rest else name), dataclasses.replace(config, publish=publish)


class _Sampler:
    """The metrics over time: every ``period_s``, each rank's true ``num_total_tokens`` and whether
    some rank idles while another has requests it has not admitted."""

    def __init__(self, n_ranks: int):
        self.n_ranks = n_ranks
        self.t: list[float] = []
        self.tokens: list[list[int]] = []
        self.idle_while_queued: list[bool] = []
        self.decoded: list[int] = []

    def take(self, t: float, ranks: list[RankModel]) -> None:
        any_idle = False
        any_queued = False
        for rank in ranks:
            if rank.state == IDLE:
                any_idle = True
            elif rank.waiting:
                any_queued = True
        self.t.append(t)
        self.tokens.append([rank.total_tokens for rank in ranks])
        self.idle_while_queued.append(any_idle and any_queued)
        self.decoded.append(sum(rank.decoded_tokens for rank in ranks))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(self.t)
        return (
            np.asarray(self.t, dtype=np.float64),
            np.asarray(self.tokens, dtype=np.int64).reshape(n, self.n_ranks),
            np.asarray(self.idle_while_queued, dtype=bool),
        )


class Simulation:
    """One method on one trace. ``run()`` returns a ``RunResult``; a Simulation runs once."""

    def __init__(self, trace: Trace, method: str, config: SimConfig):
        policy_spec, config = self._split_method(method, config)
        self.config = config.validate()
        if trace.n_ranks != config.n_ranks:
            raise InvalidInputError(
                f"trace was drawn for {trace.n_ranks} ranks but the simulation has {config.n_ranks}"
            )
        longest = int((trace.prompt_len + trace.output_len).max()) if len(trace) else 0
        if longest + 1 > config.rank.kv_capacity:
            raise InvalidInputError(
                f"a request of {longest} tokens (prompt + output) cannot fit a rank's KV capacity of "
                f"{config.rank.kv_capacity}: raise --kv-capacity, pick a larger --profile, or shorten the trace"
            )
        self.trace = trace
        self.method = method
        self.now = 0.0
        self._build(policy_spec)
        index = {id(rank): r for r, rank in enumerate(self.ranks)}
        self._members = [[index[id(rank)] for rank in group.ranks] for group in self.groups]
        self._group_of = [0] * config.n_ranks
        for group, members in zip(self.groups, self._members, strict=True):
            for r in members:
                self._group_of[r] = group.gid
        self._wire_policy()
        self.requests = [
            SimRequest(i, a, p, o, b, ids)
            for i, (a, p, o, b, ids) in enumerate(
                zip(
                    trace.arrival_s.tolist(),
                    trace.prompt_len.tolist(),
                    trace.output_len.tolist(),
                    trace.is_burst.tolist(),
                    trace.block_rows(),
                    strict=True,
                )
            )
        ]
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._publish_seq = [0] * config.n_ranks
        self._decode_since_publish = [0] * config.n_ranks
        self._idle_epoch = [0] * config.n_ranks
        self._kv_pending: deque[tuple[int, int, list[int]]] = deque()
        self._sampler = _Sampler(len(self._sampled))
        self._finished = 0
        self._ran = False
        # One handler per event kind, indexed by the kind.
        self._handlers: list[Callable[[float, int, int], None]] = [
            self._on_arrive,
            self._on_receive,
            self._on_step_end,
            self._on_publish_tick,
            self._on_idle_beat,
            self._on_sample,
            self._on_policy_tick,
            self._on_kv_event,
            self._on_wave,
        ]
        assert len(self._handlers) == BASE_EVENT_KINDS
        self._wave_at: float | None = None  # the pending _WAVE event's time (a holding policy's next look)
        self._throughput = [0.0] * config.n_ranks  # each rank's gen_throughput as SGLang logs it
        self._log_mark = [(0.0, 0, 0)] * config.n_ranks  # (time, decoded tokens, decode steps) at its last log

    def clock(self) -> float:
        return self.now

    def _split_method(self, method: str, config: SimConfig) -> tuple[Any, SimConfig]:
        return split_sim_options(method, config)

    def _build(self, policy_spec: Any) -> None:
        """The ranks, their groups, the board and the policy; per rank (the simulation's index) the
        board it publishes to, the policy that dispatches to it and its publish settings."""
        config = self.config
        self.ranks = [
            RankModel(r, config.rank, queued_prefill=config.queued_prefill, overlap=config.overlap)
            for r in range(config.n_ranks)
        ]
        if config.lockstep is None:
            self.groups = [RankGroup(r, [rank]) for r, rank in enumerate(self.ranks)]
        else:
            self.groups = [RankGroup(0, list(self.ranks), config.lockstep, config.delayer(config.n_ranks))]
        self.board = SimBoard(
            config.n_ranks, self.clock, config.publish.visibility_delay_s, lockstep=config.lockstep_section(config.n_ranks)
        )
        self.policy: Policy = make_policy(
            policy_spec,
            label=self.method,
            n_ranks=config.n_ranks,
            board=self.board,
            clock=self.clock,
            refresh_interval_s=config.refresh_interval_s,
            seed=self.trace.seed,
            prefill_delayer=config.prefill_delayer and config.lockstep is not None,
        )
        self._board_of = [self.board] * config.n_ranks
        self._policy_of = [self.policy] * config.n_ranks
        self._pub = [config.publish] * config.n_ranks
        self._sampled = self.ranks  # the ranks whose tokens the metrics over time follow
        self._tick = [(self.policy, self.ranks)]  # policies that tick, with the ranks they look at

    def _wire_policy(self) -> None:
        """Give the policy the signals its own system gives it, and nothing else."""
        for r, rank in enumerate(self.ranks):
            policy = self._policy_of[r]
            if policy.wants_request_events:
                rank.on_first_token = policy.on_first_token
                rank.on_finish = policy.on_finish
            if policy.wants_kv_events:
                rank.cache.listener = functools.partial(self._kv_event, r)

    # -- plumbing ------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def _publish(self, r: int) -> None:
        self._publish_seq[r] += 1
        self._decode_since_publish[r] = 0
        rank = self.ranks[r]
        t0, tokens0, steps0 = self._log_mark[r]
        if rank.decode_steps - steps0 >= DECODE_LOG_INTERVAL and self.now > t0:
            self._throughput[r] = (rank.decoded_tokens - tokens0) / (self.now - t0)
            self._log_mark[r] = (self.now, rank.decoded_tokens, rank.decode_steps)
        self._board_of[r].publish(
            rank.rank, rank.snapshot(self.now, self._publish_seq[r]), self.now, rank.queued_prefill_tokens,
            self._throughput[r],
        )

    def _kv_event(self, r: int, kind: int, ids: list[int]) -> None:
        """A rank's prefix cache stored or dropped blocks: the router hears of it after the
        visibility delay (the events travel like the snapshots)."""
        delay = self._pub[r].visibility_delay_s
        if delay == 0.0:
            self._policy_of[r].on_kv_event(self.ranks[r].rank, kind, ids)
        else:
            self._kv_pending.append((r, kind, ids))
            self._push(self.now + delay, _KV_EVENT)

    def _start_step(self, g: int) -> None:
        """Start group ``g``'s next step (a rank alone, or a lockstep group), publishing as each
        member's cadence says."""
        group = self.groups[g]
        duration = group.begin(self.now)
        # Under DP attention every rank runs the group's step: one with nothing of its own runs an idle
        # batch, and in an extend step a decode batch runs as an extend (convert_decode_to_extend).
        # SGLang publishes after every batch's result, forced for an extend, every 15th otherwise
        # (process_batch_result, scheduler.py 5082 in 0.5.23); only a scheduler with no batch at
        # all goes through its idle loop, which publishes at once (on_idle, 5322)
        extend_step = group.lockstep is not None and any(rank.state == PREFILL for rank in group.ranks)
        for rank, r in zip(group.ranks, self._members[g], strict=True):
            policy = self._policy_of[r]
            if policy.wants_rank_steps:
                policy.on_rank_step(rank, self.now)
            pub = self._pub[r]
            cadence = pub.cadence
            if rank.state == IDLE and duration is None:
                if cadence == "period":
                    continue
                # the idle loop publishes on every turn; beats keep an idle group's ranks fresh
                self._publish(r)
                self._idle_epoch[r] += 1
                self._push(self.now + pub.idle_publish_s, _IDLE_BEAT, r, self._idle_epoch[r])
            elif cadence == "step":
                self._publish(r)
            elif cadence == "sglang":
                if rank.state == PREFILL or (extend_step and rank.state == DECODE):
                    self._publish(r)
                else:
                    self._decode_since_publish[r] += 1
                    if self._decode_since_publish[r] >= pub.every_decode_steps:
                        self._publish(r)
        if duration is not None:
            self._push(self.now + duration, _STEP_END, g)

    # -- event handlers ------------------------------------------------------------------------

    def _on_arrive(self, t: float, rid: int, _: int) -> None:
        policy = self.policy
        if policy.holds:
            self._send(t, policy.offer(self.requests[rid]))
            self._look_again(policy)
            return
        self._send_one(t, rid, policy.dispatch(self.requests[rid]))

    def _send_one(self, t: float, rid: int, rank: int) -> None:
        """Request ``rid`` leaves the controller for ``rank`` at ``t``."""
        if not 0 <= rank < self.config.n_ranks:
            raise RuntimeError(f"method {self.method!r} picked rank {rank} of {self.config.n_ranks}")
        self._push(t + self.config.send_delay_s, _RECEIVE, rid, rank)

    def _send(self, t: float, placed: list[tuple[SimRequest, int]]) -> None:
        for req, rank in placed:
            self._send_one(t, req.rid, rank)

    def _look_again(self, policy: Policy) -> None:
        """A holding policy's timer: one pending look, at the earliest time it asks for."""
        at = policy.next_due_at()
        if at is not None and (self._wave_at is None or at < self._wave_at):
            self._wave_at = at
            self._push(at, _WAVE)

    def _on_wave(self, t: float, _a: int, _b: int) -> None:
        if self._wave_at != t:
            return  # superseded by an earlier look
        self._wave_at = None
        self._send(t, self.policy.due())
        self._look_again(self.policy)

    def _on_receive(self, t: float, rid: int, r: int) -> None:
        g = self._group_of[r]
        self.ranks[r].receive(self.requests[rid], t, self.groups[g].busy)
        self._wake(g)

    def _wake(self, g: int) -> None:
        """A member of group ``g`` has new work: an idle group starts a step now (a busy one
        finds the work when its step ends)."""
        if not self.groups[g].busy:
            for r in self._members[g]:
                self._idle_epoch[r] += 1  # cancels its idle beat
            self._start_step(g)

    def _on_step_end(self, t: float, g: int, _: int) -> None:
        self._finished += self.groups[g].end(t)
        self._start_step(g)

    def _on_publish_tick(self, t: float, r: int, _: int) -> None:
        self._publish(r)
        self._push(t + self._pub[r].period_s, _PUBLISH_TICK, r)

    def _on_idle_beat(self, t: float, r: int, epoch: int) -> None:
        if self.ranks[r].state == IDLE and epoch == self._idle_epoch[r]:
            self._publish(r)
            self._push(t + self._pub[r].idle_publish_s, _IDLE_BEAT, r, epoch)

    def _on_sample(self, t: float, _a: int, _b: int) -> None:
        self._sampler.take(t, self._sampled)
        self._push(t + self.config.sample_period_s, _SAMPLE)

    def _on_policy_tick(self, t: float, i: int, _b: int) -> None:
        policy, ranks = self._tick[i]
        policy.on_tick(t, ranks)
        self._push(t + policy.tick_period_s, _POLICY_TICK, i)

    def _on_kv_event(self, t: float, _a: int, _b: int) -> None:
        r, kind, ids = self._kv_pending.popleft()
        self._policy_of[r].on_kv_event(self.ranks[r].rank, kind, ids)

    # -- the loop ------------------------------------------------------------------------------

    def _schedule_start(self) -> None:
        cfg = self.config
        for req in self.requests:
            self._push(req.arrival_s, _ARRIVE, req.rid)
        for r in range(cfg.n_ranks):
            self._publish(r)  # every rank announces itself (empty) at start, as a live scheduler would
            pub = self._pub[r]
            if pub.cadence == "period":
                self._push(pub.period_s * (r + 1) / cfg.n_ranks, _PUBLISH_TICK, r)
            else:
                self._idle_epoch[r] += 1
                self._push(pub.idle_publish_s, _IDLE_BEAT, r, self._idle_epoch[r])
        self._push(0.0, _SAMPLE)
        for i, (policy, _) in enumerate(self._tick):
            if policy.tick_period_s > 0:
                self._push(0.0, _POLICY_TICK, i)

    def run(self) -> RunResult:
        if self._ran:
            raise RuntimeError("a Simulation runs once; make a new one for another run")
        self._ran = True
        wall0 = time.perf_counter()
        self._schedule_start()
        n_total = len(self.requests)
        last_arrival = self.requests[-1].arrival_s if self.requests else 0.0
        deadline = last_arrival + self.config.drain_limit_s
        heap = self._heap
        handlers = self._handlers
        while self._finished < n_total:
            if not heap:
                raise RuntimeError(f"simulation of {self.method!r} ran out of events with requests unfinished")
            t, _, kind, a, b = heapq.heappop(heap)
            if t > deadline:
                raise RuntimeError(
                    f"simulation of {self.method!r} did not drain within {self.config.drain_limit_s:g} simulated "
                    f"seconds of the last arrival ({self._finished}/{n_total} requests finished): the trace "
                    f"overloads the ranks (lower --load)"
                )
            self.now = t
            handlers[kind](t, a, b)
        for rank in self.ranks:  # the last step's results, processed as the loop finds nothing more
            rank.flush_results(self.now)
        return self._result(time.perf_counter() - wall0)

    def _result(self, wall_s: float) -> RunResult:
        sample_t, sample_tokens, sample_iwq = self._sampler.arrays()
        if self.config.frontend_s:  # what the client sees: the path out and back on top of the ranks' times
            for req in self.requests:
                req.first_token_s += self.config.frontend_s
                req.finished_s += self.config.frontend_s
        return RunResult(
            method=self.method,
            requests=self.requests,
            sample_t=sample_t,
            sample_tokens=sample_tokens,
            sample_idle_while_queued=sample_iwq,
            publishes=self.board.publishes,
            board_reads=self.board.reads,
            retractions=sum(rank.retracted for rank in self.ranks),
            evicted_tokens=sum(rank.cache.evicted_tokens for rank in self.ranks),
            end_s=self.now + self.config.frontend_s,
            wall_s=wall_s,
            slo_ttft_s=self.config.slo_ttft_s,
            slo_tpot_s=self.config.slo_tpot_s,
            lockstep=self.config.lockstep is not None,
            group_steps=sum(g.steps for g in self.groups),
            rank_steps=sum(g.rank_steps for g in self.groups),
            idle_rank_steps=sum(g.idle_rank_steps for g in self.groups),
            extend_steps=sum(g.extend_steps for g in self.groups),
            eager_decode_rank_steps=sum(g.eager_decode_rank_steps for g in self.groups),
            sample_decoded=np.asarray(self._sampler.decoded, dtype=np.int64),
            delayer_held_passes=sum(g.delayer.held_passes for g in self.groups if g.delayer is not None),
            delayer_timeouts=sum(g.delayer.timeouts for g in self.groups if g.delayer is not None),
            stalled_decodes=sum(g.stalled_decodes for g in self.groups),
            held_s=self._held_s(),
        )

    def _held_s(self) -> np.ndarray:
        """Per request, how long the controller held it before sending it (0 for a policy that holds
        nothing): its receipt less the transit, less its arrival."""
        if not self.policy.holds:
            return np.zeros(len(self.requests))
        received = np.array([req.received_s for req in self.requests])
        arrival = np.array([req.arrival_s for req in self.requests])
        return np.maximum(received - self.config.send_delay_s - arrival, 0.0)


def simulate(trace: Trace, methods: list[str], config: SimConfig) -> list[RunResult]:
    """Run every method on the same trace, one after another, each from a fresh cluster."""
    return [Simulation(trace, m, config).run() for m in methods]


def default_methods() -> list[str]:
    """The seed methods, the peers' routers and every improved method the controller offers."""
    from dpboard.sim.methods import seed_and_improved
    from dpboard.sim.peers import PEERS

    seeds, improved = seed_and_improved()
    return [*seeds, *PEERS, *improved]


def config_dict(config: SimConfig) -> dict[str, Any]:
    return asdict(config)
