"""``inflight_wave``'s hold: arrivals kept back while ranks in lockstep decode, released together.

Under DP attention one rank's prefill makes the group's step an extend step for every rank, and
its running decodes wait for it. Prompts that arrive one by one while the group decodes stall it
once each; held and released together they are prefilled in the same steps, one stall for the
wave (docs/DISPATCH.md, "inflight_wave"). The rule, read from the budget after each refresh:

- **hold** an arrival while some candidate rank decodes (it runs requests: a prefill would stall
  it), unless, with the idle clause, a rank is idle and no rank has prefill queued or in flight
  (that rank would sit the wait out);
- **release** every held request at once when the held fill a wave (``wave_per_rank`` per
  candidate rank), when their frames reach ``max_bytes`` (the caller's byte bound: the ZMQ
  controller's ``--max-queued-mib``), when the group can no longer wait (the rule above), or when the oldest has been
  held its bound: the hold budget less one group step (a released prompt still waits for the step
  under way), the step read from the board as the ranks' running requests over their decode
  throughput (SGLang's ``gen_throughput``), no more than half the budget taken off.

The class is pure: the Dispatcher gives it the budget's arrays and the clock's time, and places what
it releases. Nothing here waits; ``next_due_at`` says when the caller's loop should look again.
``counts`` is what it did (held, waves, releases by reason, the longest hold against its budget,
bytes held), as the dispatch record carries it to ``dpboard top`` and ``/metrics``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from dpboard.board.dispatch_record import WAVE_REASONS, WaveCounts
from dpboard.errors import InvalidInputError

# The longest any request is held, seconds, less a group step: 0.4 of the 5 s time-to-first-token
# objective of DeepSeek-V3's DP-attention deployment (the simulator's deepseek-v3-dp-attention-h100
# profile), chosen among 1-3 s on the DP-attention cells (docs/DISPATCH.md, "inflight_wave")
DEFAULT_WAVE_HOLD = 2.0
MAX_WAVE_HOLD = 60.0  # seconds: past this a hold is an outage, not a wave
# a wave is full with this many held requests per candidate rank (1, 2, 4 and 8 measured: 4 and 8
# alike, 1 and 2 leave before the group has enough to share)
DEFAULT_WAVE_PER_RANK = 4
MAX_WAVE_PER_RANK = 10_000
# why a wave left: what the dispatch record counts ("order": a control message must not overtake
# them; "bytes": what it held reached the caller's byte bound)
REASONS = WAVE_REASONS


class WaveHold:
    """The requests held for the next wave, and when they leave."""

    __slots__ = ("max_hold", "wave_per_rank", "idle", "max_bytes", "_held", "_since", "held_total", "released",
                 "waves", "hold_sum", "hold_max", "step", "held_bytes", "held_bytes_max")

    def __init__(self, max_hold: float = DEFAULT_WAVE_HOLD, wave_per_rank: int = DEFAULT_WAVE_PER_RANK, idle: bool = True,
                 max_bytes: int | None = None):
        if not isinstance(max_hold, (int, float)) or isinstance(max_hold, bool) or not 0 <= max_hold <= MAX_WAVE_HOLD:
            raise InvalidInputError(f"wave_max_hold must be seconds in [0, {MAX_WAVE_HOLD:g}] (a share of the TTFT objective), "
                                    f"got {max_hold!r}")
        if not isinstance(wave_per_rank, int) or isinstance(wave_per_rank, bool) or wave_per_rank < 1:
            raise InvalidInputError(f"wave_per_rank must be an int >= 1 (a wave is full with this many requests "
                                    f"per candidate rank), got {wave_per_rank!r}")
        self.max_hold = float(max_hold)
        self.idle = bool(idle)
        self.max_bytes: int | None = None
        self.bound_bytes(max_bytes)
        self.wave_per_rank = wave_per_rank
        self._held: deque[Any] = deque()
        self._since: deque[float] = deque()
        self.held_total = 0  # requests ever held
        self.released = dict.fromkeys(REASONS, 0)  # requests released, by the reason their wave left
        self.waves = 0
        self.hold_sum = 0.0  # seconds held, summed over released requests
        self.hold_max = 0.0
        self.step = 0.0  # the group step last read from the board, seconds (0: not known)
        self.held_bytes = 0  # the held requests' frames, bytes (what the caller said of each)
        self.held_bytes_max = 0

    def bound_bytes(self, max_bytes: int | None) -> None:
        """Release the held once their frames reach ``max_bytes`` (None: no byte bound)."""
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1):
            raise InvalidInputError(f"the wave's max_bytes must be an int >= 1 (bytes of held frames, the "
                                    f"controller's --max-queued-mib) or None, got {max_bytes!r}")
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._held)

    def bound(self) -> float:
        """How long the oldest may be held: the hold budget less one group step, and at least half the
        budget. SGLang's gen_throughput is the tokens of its last 40 decode steps over the time since
        its previous decode log, idle time included: the first read after an idle gap gives a step of
        seconds that no group takes (a step that long would leave nothing worth holding for)."""
        return max(0.0, self.max_hold - min(self.step, self.max_hold / 2))

    def read_step(self, running: np.ndarray, throughput: np.ndarray, candidate: np.ndarray) -> None:
        """The group's decode step from the board: the candidate ranks' running requests over their
        decode throughput, the longest (in lockstep every rank waits for the slowest)."""
        known = (candidate != 0) & (throughput > 0) & (running > 0)
        self.step = float(np.max(running[known] / throughput[known])) if known.any() else 0.0

    def can_wait(self, running: np.ndarray, backlog: np.ndarray, candidate: np.ndarray) -> bool:
        """Some candidate rank decodes (a prefill would stall it), and, with ``idle``, no rank is
        idle while none is about to prefill (the idle rank's share of the group is wasted)."""
        cand = candidate != 0
        busy = running[cand] > 0
        if not busy.any():
            return False
        # an idle rank (nothing running, nothing queued) while nothing is queued anywhere
        return not (self.idle and not busy.all() and not (backlog[cand] > 0).any())

    def hold(self, req: Any, now: float, nbytes: int = 0) -> None:
        """Hold ``req`` from ``now``; ``nbytes``: its frame's size, counted against ``max_bytes``."""
        self._held.append(req)
        self._since.append(now)
        self.held_total += 1
        self.held_bytes += nbytes
        if self.held_bytes > self.held_bytes_max:
            self.held_bytes_max = self.held_bytes

    def over_bytes(self) -> bool:
        """What is held has reached the byte bound."""
        return self.max_bytes is not None and self.held_bytes >= self.max_bytes

    def reason(self, now: float, can_wait: bool, candidates: int) -> str | None:
        """Why the held requests leave now, or None while they stay."""
        if not self._held:
            return None
        if len(self._held) >= self.wave_per_rank * max(1, candidates):
            return "full"
        if self.over_bytes():
            return "bytes"
        if not can_wait:
            return "busy"
        if now >= self._since[0] + self.bound():  # the sum next_due_at gives: no float gap between them
            return "bound"
        return None

    def next_due_at(self, refresh_at: float) -> float | None:
        """When the caller should look again: the oldest's bound, or the next refresh of the board
        (which may show a rank idle or about to prefill), whichever comes first."""
        if not self._since:
            return None
        return min(self._since[0] + self.bound(), refresh_at)

    def counts(self) -> WaveCounts:
        """What the hold did so far, and holds now."""
        return WaveCounts(held=self.held_total, holding=len(self._held), waves=self.waves, hold_sum_s=self.hold_sum,
                          hold_max_s=self.hold_max, max_hold_s=self.max_hold, held_bytes=self.held_bytes,
                          held_bytes_max=self.held_bytes_max, released=tuple(self.released[r] for r in REASONS))

    def take(self, now: float, reason: str) -> list[Any]:
        """Every held request, oldest first, counted as released for ``reason``."""
        out = list(self._held)
        for since in self._since:
            waited = max(0.0, now - since)
            self.hold_sum += waited
            if waited > self.hold_max:
                self.hold_max = waited
        self._held.clear()
        self._since.clear()
        self.held_bytes = 0
        if out:
            self.released[reason] += len(out)
            self.waves += 1
        return out
