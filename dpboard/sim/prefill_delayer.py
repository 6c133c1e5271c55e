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
batch. The running batch a rank reports is SGLang's ``running_batch.batch_size()``
(``RankModel.running_batch``): under the overlap scheduler it still counts the requests that
finished in the step just ended, whose result is processed only after this pass.

The queue trigger (``--prefill-delayer-queue-min-ratio``, off by default; prefill_delayer.py 86-95
and 251-272) is modelled as an option (``queue_min_ratio``). When every rank could prefill and the
largest running batch is not empty, it also holds prefill back while the longest waiting queue is
below ``min(int(max running * ratio), capacity)``, the capacity being ``--prefill-max-requests``
when set, else the largest recent prefill batch. It stops holding once the wait has lasted
``--prefill-delayer-max-delay-ms`` (5000 ms when unset), on the simulated clock from the wait's first
held pass, and any hold ends when ``max_delay_passes`` runs out, whichever comes first (the slot rule
above may go on holding past the 5000 ms). Its waiting queue is what the
scheduler has taken in (``RankModel.ingested_waiting``). ``prefill_max_requests`` is the delayer's
use of it only: the rank model does not cap its prefill batches at it.

The low-watermark trigger is off by default (``prefill_delayer_*`` in
``arg_groups/fields/schedule.py``) and not modelled. A pass in which the hold leaves the whole
group without tokens runs no forward: SGLang's loop gathers again at once, a pass that costs the
profile's ``idle_pass_ms`` (``LockstepCost.idle_pass_s``, default ``IDLE_PASS_S``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankModel

MAX_DELAY_PASSES = 30  # --prefill-delayer-max-delay-passes default
# --prefill-delayer-max-delay-ms unset: the queue trigger's cap (prefill_delayer.py 90-94)
MAX_DELAY_S = 5.0
PREFILL_BS_WINDOW = 16  # SGLANG_PREFILL_DELAYER_MAX_PREFILL_BS_WINDOW_SIZE default
# A scheduler pass without a forward (two CPU all-gathers over the group): an estimate, not a
# measurement, and the default of a profile's idle_pass_ms. It bounds how fast a held group with
# nothing else to do goes through its passes.
IDLE_PASS_S = 0.001


class PrefillDelayer:
    """The verdict of one lockstep group's prefill delayer, pass by pass.

    ``queue_min_ratio`` (None: off, SGLang's default) turns the queue trigger on, with its cap
    ``max_delay_s`` and ``prefill_max_requests`` (None: the largest recent prefill batch)."""

    __slots__ = (
        "max_delay_passes",
        "queue_min_ratio",
        "max_delay_s",
        "prefill_max_requests",
        "delayed",
        "wait_start_s",
        "skip_first",
        "_recent",
        "_ready",
        "_running",
        "_waiting",
        "held_passes",
        "timeouts",
        "queue_timeouts",
    )

    def __init__(
        self,
        n_ranks: int,
        max_delay_passes: int = MAX_DELAY_PASSES,
        *,
        queue_min_ratio: float | None = None,
        max_delay_s: float = MAX_DELAY_S,
        prefill_max_requests: int | None = None,
    ):
        if max_delay_passes < 1:
            raise InvalidInputError(f"prefill delayer max_delay_passes must be >= 1, got {max_delay_passes}")
        if queue_min_ratio is not None and not (math.isfinite(queue_min_ratio) and queue_min_ratio > 0):
            raise InvalidInputError(
                f"prefill delayer queue_min_ratio must be a number > 0 (SGLang's typical 0.1 to 0.5), or None "
                f"to leave the queue trigger off, got {queue_min_ratio}"
            )
        if not (math.isfinite(max_delay_s) and max_delay_s >= 0):
            raise InvalidInputError(f"prefill delayer max_delay_s must be >= 0 seconds (default 5), got {max_delay_s}")
        if prefill_max_requests is not None and prefill_max_requests < 1:
            raise InvalidInputError(
                f"prefill delayer prefill_max_requests must be >= 1, or None for no limit, got {prefill_max_requests}"
            )
        self.max_delay_passes = max_delay_passes
        self.queue_min_ratio = queue_min_ratio
        self.max_delay_s = max_delay_s
        self.prefill_max_requests = prefill_max_requests
        self.delayed: int | None = None  # passes held so far in the current wait (None: no wait)
        self.wait_start_s = 0.0  # the current wait's first held pass (SGLang's _State.start_time)
        self.skip_first = True
        self._recent = [deque(maxlen=PREFILL_BS_WINDOW) for _ in range(n_ranks)]
        self._ready = [False] * n_ranks  # this pass: which ranks reported they could prefill
        self._running = [0] * n_ranks  # this pass: each rank's running batch, as it reported it
        self._waiting = [0] * n_ranks  # this pass: each rank's waiting queue, as the queue trigger reads it
        self.held_passes = 0  # the record: passes in which prefill was held back
        self.timeouts = 0  # waits that ended because max_delay_passes ran out
        self.queue_timeouts = 0  # passes in which max_delay_s lifted the queue trigger's hold

    def max_prefill_bs(self, r: int) -> int:
        return max(self._recent[r], default=0)

    def allow(self, ranks: Sequence[RankModel], now_s: float) -> bool:
        """The verdict of the pass that starts at ``now_s`` (every rank of the group gets the same);
        updates the wait."""
        ready, running, waiting = self._ready, self._running, self._waiting
        for r, rank in enumerate(ranks):
            ready[r] = rank.prefill_ready()
            running[r] = rank.running_batch
            waiting[r] = rank.ingested_waiting
        n_ready = sum(ready)
        if n_ready == 0:
            self.delayed = None
            return True
        if n_ready == len(ranks):
            cfg = ranks[0].config
            running_max = max(running)
            prefill_bs = max(self.max_prefill_bs(r) for r in range(len(ranks)))
            # prefill_delayer.py 256-272: hold until the longest queue reaches the ratio of the
            # largest running batch (capped), unless the wait, timed from its first held pass
            # before this pass's gather (190-195), has lasted max_delay_ms
            queue_condition = False
            ratio = self.queue_min_ratio
            if ratio is not None and running_max > 0:
                capacity = self.prefill_max_requests if self.prefill_max_requests is not None else prefill_bs
                queue_min = min(int(running_max * ratio), capacity)
                queue_condition = queue_min > 0 and max(waiting) < queue_min
                if queue_condition and self.delayed is not None and now_s - self.wait_start_s >= self.max_delay_s:
                    queue_condition = False
                    self.queue_timeouts += 1
            slot_condition = cfg.max_running - running_max < prefill_bs
            if not (slot_condition or queue_condition):
                self.delayed = None
                return True
            if self.skip_first:
                self.skip_first = False
                self.delayed = None
                return True
        held = self.delayed or 0
        if held < self.max_delay_passes - 1:
            if self.delayed is None:
                self.wait_start_s = now_s
            self.delayed = held + 1
            self.held_passes += 1
            return False
        self.delayed = None
        self.timeouts += 1
        return True

    def observe(self, ranks: Sequence[RankModel], allowed: bool) -> None:
        """After the pass: each rank's prefill batch size, or, for a rank held back, SGLang's estimate
        of the batch it would have run (``_estimate_attempted_prefill_bs``, prefill_delayer.py 407-427,
        from the running batch the rank reported). The estimate counts the whole waiting queue,
        requests the overlap scheduler takes in a pass later included, where SGLang passes the
        queue it has taken in (the ``ingested_waiting`` the queue trigger reads)."""
        for r, rank in enumerate(ranks):
            size = rank.prefill_batch_size
            if size == 0 and not allowed and self._ready[r]:
                cfg = rank.config
                size = min(max(len(rank.waiting), 1), max(cfg.max_running - self._running[r], 1))
            if size > 0:
                self._recent[r].append(size)
