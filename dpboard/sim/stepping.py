"""When a group of ranks steps and how long a step lasts: independent ranks, or DP attention's lockstep.

A ``RankGroup`` is the unit the ``Simulation`` loop steps. Independent ranks are groups of one: a
step lasts what the rank's own model says (``RankModel.begin_step``). Under DP attention
(``--dp-attention``) the ranks of a group step together, as SGLang 0.5.23 runs them: before every
forward each rank's scheduler gathers every other rank's batch (``prepare_mlp_sync_batch_raw`` in
``sglang/srt/managers/scheduler_components/dp_attn.py``), then all run the layers together because
the MoE layers exchange every rank's tokens (DeepEP all-to-all). So:

- a group step starts once every rank has ended the previous one, and each rank forms its own batch
  as it would alone (prefill or decode);
- a rank with nothing to do runs an idle batch of zero tokens whenever another rank has tokens
  (``need_idle_batch = max(global_num_tokens) > 0``); when no rank has any, nobody steps;
- ``is_extend_in_batch`` is the maximum over ranks and the decode CUDA graph is used only if every
  rank votes for it (``can_run_decode_cuda_graph = min(...)``): one rank's prefill makes every
  decoding rank run its decode without the graph that step;
- the step lasts

      T = base + max_r attention_r + moe_prefill * P / n + moe_decode * D / n

  with ``base`` the profile's fixed step cost (the prefill one when any rank extends), ``P`` and
  ``D`` the group's prefill and decode tokens of the step (a decode rank's tokens are its batch
  size, SGLang's ``num_tokens``), ``n`` the group's size, and a rank's own part

      prefill:  (prefill_token - moe_prefill) * tokens computed
      decode:   (decode_request - moe_decode) * batch + decode_kv_token * KV held [+ eager_decode in an extend step]

  The routed experts are spread over the group (expert parallelism), so their cost follows the
  group's mean tokens; attention, the dense layers and the shared expert run on each rank's own
  tokens. With every rank holding the same batch, ``T`` is the independent rank's step cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpboard.errors import InvalidInputError
from dpboard.sim.model import DECODE, IDLE, PREFILL, RankConfig, RankModel
from dpboard.sim.prefill_delayer import IDLE_PASS_S, PrefillDelayer


@dataclass(frozen=True)
class LockstepCost:
    """The parts of a step that DP attention shares across its group (the profile's ``moe_*`` and
    ``eager_decode_ms``)."""

    moe_prefill_s_per_token: float = 0.0  # routed-expert cost of one prompt token, spread over the group
    moe_decode_s_per_token: float = 0.0  # routed-expert cost of one decode token, spread over the group
    eager_decode_s: float = 0.0  # what a decode batch pays without its CUDA graph (a step in which some rank extends)
    # DeepEP's auto mode runs a step with an extend in normal mode for every rank, slower than the
    # low-latency mode of decode steps: the extra cost of such a step, for the whole group
    extend_dispatch_s: float = 0.0
    # a pass of SGLang's loop with no forward (the prefill delayer held the only work there was)
    idle_pass_s: float = IDLE_PASS_S

    def validate(self, rank: RankConfig) -> LockstepCost:
        for name in ("moe_prefill_s_per_token", "moe_decode_s_per_token", "eager_decode_s", "extend_dispatch_s"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"lockstep {name} must be >= 0 seconds")
        if not self.idle_pass_s > 0:
            raise InvalidInputError("lockstep idle_pass_s must be > 0 seconds: a pass of the scheduler's loop takes time")
        if self.moe_prefill_s_per_token > rank.prefill_s_per_token:
            raise InvalidInputError(
                "moe_prefill_token_us is part of prefill_token_us: it cannot exceed it "
                f"({self.moe_prefill_s_per_token * 1e6:g} > {rank.prefill_s_per_token * 1e6:g} us)"
            )
        if self.moe_decode_s_per_token > rank.decode_s_per_request:
            raise InvalidInputError(
                "moe_decode_token_us is part of decode_request_us: it cannot exceed it "
                f"({self.moe_decode_s_per_token * 1e6:g} > {rank.decode_s_per_request * 1e6:g} us)"
            )
        return self


class RankGroup:
    """Ranks that step together (``lockstep`` given) or one rank alone (``lockstep`` None).

    ``begin`` forms every member's next batch and returns the step's duration, or None when no member
    has anything to do; ``end`` applies the step. The counters are the group's record: steps run,
    rank-steps, rank-steps spent in an idle batch, steps with an extend, decode rank-steps that ran
    without their CUDA graph."""

    __slots__ = (
        "gid",
        "ranks",
        "lockstep",
        "config",
        "busy",
        "steps",
        "rank_steps",
        "idle_rank_steps",
        "extend_steps",
        "eager_decode_rank_steps",
        "_attn_prefill",
        "_attn_decode",
        "delayer",
        "held_idle_passes",
        "stalled_decodes",
    )

    def __init__(
        self,
        gid: int,
        ranks: list[RankModel],
        lockstep: LockstepCost | None = None,
        delayer: PrefillDelayer | None = None,
    ):
        if not ranks:
            raise InvalidInputError("a rank group needs at least one rank")
        if lockstep is None and len(ranks) != 1:
            raise InvalidInputError("independent ranks step one to a group: give the group a LockstepCost")
        if delayer is not None and lockstep is None:
            raise InvalidInputError("the prefill delayer holds a lockstep group's prefill: it needs DP attention")
        self.delayer = delayer
        self.gid = gid
        self.ranks = ranks
        self.config = ranks[0].config
        self.lockstep = lockstep.validate(self.config) if lockstep is not None else None
        self.busy = False
        # steps of the group; rank steps, those idle, those eager (no CUDA graph); extend steps
        self.steps = self.rank_steps = self.idle_rank_steps = self.eager_decode_rank_steps = self.extend_steps = 0
        self.held_idle_passes = 0  # passes without a forward: the delayer held the only work there was
        self.stalled_decodes = 0  # running requests that got no token because their rank prefilled
        if lockstep is not None:
            self._attn_prefill = self.config.prefill_s_per_token - lockstep.moe_prefill_s_per_token
            self._attn_decode = self.config.decode_s_per_request - lockstep.moe_decode_s_per_token

    def begin(self, now_s: float) -> float | None:
        if self.lockstep is None:
            rank = self.ranks[0]
            duration = rank.begin_step(now_s)
            if duration is None and rank.fenced:
                duration = rank.reform_unfenced(now_s)
            self.busy = duration is not None
            if duration is None:
                rank.flush_results(now_s)
            else:
                self.steps += 1
                self.rank_steps += 1
                rank.busy_s += duration
                if rank.state == PREFILL:
                    self.stalled_decodes += len(rank.running)
            return duration
        delayer = self.delayer
        allow = True if delayer is None else delayer.allow(self.ranks, now_s)
        for rank in self.ranks:
            rank.begin_step(now_s, allow)
        duration = self._lockstep_s()
        if duration is None and any(rank.fenced for rank in self.ranks):
            for rank in self.ranks:
                rank.reform_unfenced(now_s, allow)
            duration = self._lockstep_s()
        if delayer is not None:
            delayer.observe(self.ranks, allow)
            if duration is None and not allow:
                # the hold left nobody with tokens: no forward, the loop gathers again at once
                self.held_idle_passes += 1
                duration = self.lockstep.idle_pass_s
        self.busy = duration is not None
        if duration is None:
            for rank in self.ranks:
                rank.flush_results(now_s)
        return duration

    def _lockstep_s(self) -> float | None:
        cfg = self.config
        cost = self.lockstep
        assert cost is not None
        extend = False
        prefill_tokens = 0
        decode_tokens = 0
        idle = 0
        for rank in self.ranks:
            state = rank.state
            if state == PREFILL:
                extend = True
                prefill_tokens += rank.step_tokens
            elif state == DECODE:
                decode_tokens += rank.step_tokens
            else:
                idle += 1
        n = len(self.ranks)
        if idle == n:
            return None
        eager = cost.eager_decode_s if extend else 0.0
        attention = 0.0
        eager_ranks = 0
        for rank in self.ranks:
            state = rank.state
            if state == PREFILL:
                own = self._attn_prefill * rank.step_tokens + cfg.prefill_s_per_attention_pair * rank.step_pairs
                self.stalled_decodes += len(rank.running)
            elif state == DECODE:
                own = self._attn_decode * rank.step_tokens + cfg.decode_s_per_kv_token * rank.step_kv_tokens + eager
                if rank.after_prefill:
                    own += cfg.decode_after_prefill_s
                eager_ranks += 1
            else:
                continue
            if own > attention:
                attention = own
        base = cfg.prefill_base_s + cost.extend_dispatch_s if extend else cfg.decode_base_s
        duration = (
            base
            + attention
            + (cost.moe_prefill_s_per_token * prefill_tokens + cost.moe_decode_s_per_token * decode_tokens) / n
        )
        self.steps += 1
        self.rank_steps += n
        self.idle_rank_steps += idle
        if extend:
            self.extend_steps += 1
            self.eager_decode_rank_steps += eager_ranks
        for rank in self.ranks:
            if rank.state != IDLE:
                rank.busy_s += duration
        return duration

    def end(self, now_s: float) -> int:
        """Apply the step that just ended on every member; returns how many requests finished."""
        self.busy = False
        done = 0
        for rank in self.ranks:
            done += rank.end_step(now_s)
        return done
