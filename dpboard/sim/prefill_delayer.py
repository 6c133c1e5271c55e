"""SGLang's prefill delayer (``--enable-prefill-delayer``) for a lockstep group, with its defaults.

Under DP attention a step in which any rank extends is an extend step for every rank, so SGLang can
hold prefill back until the ranks want to prefill together (``sglang/srt/managers/prefill_delayer.py``
of 0.5.23, ``PrefillDelayer._negotiate_should_allow_prefill_pure``). Every scheduler pass, each rank
reports whether it could prefill (``local_prefillable``: a prompt mid-chunk, or a waiting request
that passed the admission checks, from ``PrefillAdder``, ``schedule_policy.py``), its running batch
and the largest of its last 16 prefill batches (``RecentPrefillBatchSizeTracker``); the group
gathers them and every rank takes the same verdict:

- **none** can prefill: allow (nothing to hold); the wait, if any, ends;
- **mixed**: hold prefill back while the passes already held number fewer than
  ``max_delay_passes - 1`` (default 30), then allow ("wait_timeout");
- **all** can prefill: allow, unless ``max_running - max(running) < max(max_prefill_bs)`` (a prefill
  would not fit the decode batch's room), which holds it back in the same way except the very first
  time (``skip_first_delayer``).

A held rank still continues a prompt it is chunking ("A mid-chunk rank prefills this pass regardless
of the delayer verdict") but admits nothing new; it decodes its running batch, or runs an idle
batch. The low-watermark and queue triggers are off by default (``prefill_delayer_*`` in
``arg_groups/fields/schedule.py``) and not modelled. A pass in which the hold leaves the whole
group without tokens runs no forward: SGLang's loop gathers again at once, a pass that costs the
profile's ``idle_pass_ms`` (``LockstepCost.idle_pass_s``, default ``IDLE_PASS_S``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankModel

MAX_DELAY_PASSES = 30  # --prefill-delayer-max-delay-passes default
PREFILL_BS_WINDOW = 16  # SGLANG_PREFILL_DELAYER_MAX_PREFILL_BS_WINDOW_SIZE default
# A scheduler pass without a forward (two CPU all-gathers over the group): an estimate, not a
# measurement, and the default of a profile's idle_pass_ms. It bounds how fast a held group with
# nothing else to do goes through its passes.
IDLE_PASS_S = 0.001


class PrefillDelayer:
    """The verdict of one lockstep group's prefill delayer, pass by pass."""

    __slots__ = ("max_delay_passes", "delayed", "skip_first", "_recent", "_ready", "held_passes", "timeouts")

    def __init__(self, n_ranks: int, max_delay_passes: int = MAX_DELAY_PASSES):
        if max_delay_passes < 1:
            raise InvalidInputError(f"prefill delayer max_delay_passes must be >= 1, got {max_delay_passes}")
        self.max_delay_passes = max_delay_passes
        self.delayed: int | None = None  # passes held so far in the current wait (None: no wait)
        self.skip_first = True
        self._recent = [deque(maxlen=PREFILL_BS_WINDOW) for _ in range(n_ranks)]
        self._ready = [False] * n_ranks  # this pass: which ranks reported they could prefill
        self.held_passes = 0  # the record: passes in which prefill was held back
        self.timeouts = 0  # waits that ended because max_delay_passes ran out

    def max_prefill_bs(self, r: int) -> int:
        return max(self._recent[r], default=0)

    def allow(self, ranks: Sequence[RankModel]) -> bool:
        """The verdict of this pass (every rank of the group gets the same); updates the wait."""
        ready = self._ready
        for r, rank in enumerate(ranks):
            ready[r] = rank.prefill_ready()
        n_ready = sum(ready)
        if n_ready == 0:
            self.delayed = None
            return True
        if n_ready == len(ranks):
            cfg = ranks[0].config
            running = max(len(rank.running) for rank in ranks)
            prefill_bs = max(self.max_prefill_bs(r) for r in range(len(ranks)))
            if not cfg.max_running - running < prefill_bs:
                self.delayed = None
                return True
            if self.skip_first:
                self.skip_first = False
                self.delayed = None
                return True
        held = self.delayed or 0
        if held < self.max_delay_passes - 1:
            self.delayed = held + 1
            self.held_passes += 1
            return False
        self.delayed = None
        self.timeouts += 1
        return True

    def observe(self, ranks: Sequence[RankModel], allowed: bool) -> None:
        """After the pass: each rank's prefill batch size, or, for a rank held back, SGLang's estimate
        of the batch it would have run (``_estimate_attempted_prefill_bs``)."""
        for r, rank in enumerate(ranks):
            size = rank.prefill_batch_size
            if size == 0 and not allowed and self._ready[r]:
                cfg = rank.config
                size = min(max(len(rank.waiting), 1), max(cfg.max_running - len(rank.running), 1))
            if size > 0:
                self._recent[r].append(size)
