"""``auto`` decided from the board as it is (docs/DISPATCH.md, rule 1), by the controller and the simulator alike.

``auto`` is round_robin, or inflight_lockstep where the ranks step in lockstep (DP attention, vLLM's
MoE DP); a PD prefill server's is follow_bootstrap_room, a PD decode server's round_robin: the rows of
``dpboard.methods.METHODS`` that list those deployments (``auto_pick``). Whether the ranks step in lockstep is on the board: each rank's
lockstep section. A controller is usually started before its schedulers publish, so a decision
taken once, at start, would be round_robin for the controller's whole life: ``AutoMethod`` looks
again, at most every ``AUTO_CHECK_INTERVAL`` seconds (at every check while no slot is live yet),
and builds a new ``Dispatcher`` when the answer changes. ``auto_method`` is the one rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dpboard.methods import LoadBalanceMethod, auto_pick
from dpboard.snapshot import DETAIL_FLAG, DETAILED_DTYPE, SlotStatus

AUTO_CHECK_INTERVAL = 1.0  # seconds between two looks at the board's lockstep sections, once a slot is live
_LIVE = int(SlotStatus.LIVE)
_LOCKSTEP = np.uint64(DETAIL_FLAG["lockstep"])


def lockstep_on_board(reader: Any, num_workers: int, out: np.ndarray | None = None) -> bool | None:
    """Whether the board says its ranks step in lockstep: a live slot whose lockstep section counts a
    group of more than one rank. None while no slot of the ``num_workers`` is live (nothing to go
    by yet); False for a reader without details."""
    read = getattr(reader, "read_detailed_array", None)
    if read is None:
        return False
    records = read(np.zeros(num_workers, DETAILED_DTYPE) if out is None else out)[:num_workers]
    live = records["load"]["status"] == _LIVE
    if not live.any():
        return None
    detail = records["detail"]
    present = (detail["flags"] & _LOCKSTEP) != 0
    return bool((present & live & (detail["lockstep_group_size"] > 1)).any())


def auto_method(reader: Any, num_workers: int, disaggregation_mode: str | None = None, *,
                lockstep: bool | None = None) -> LoadBalanceMethod:
    """What ``auto`` is now: resolved with ``lockstep`` when given, else with what the board says
    (``lockstep_on_board``; a board with nothing live yet, or no reader: not in lockstep)."""
    if lockstep is None:
        lockstep = bool(reader is not None and lockstep_on_board(reader, num_workers))
    return auto_pick(disaggregation_mode, lockstep=lockstep)


class AutoMethod:
    """``auto`` that follows the board: ``dispatcher`` is the Dispatcher of the method ``auto`` is
    now, built by ``build(method)``; ``check()`` looks at the board again when due and returns True
    when it built a new one (the caller then dispatches with it). Each change is logged once.

    ``lockstep`` given (True or False) fixes the answer: nothing is read again. ``clock``: seconds
    (the simulator's clock there, ``time.monotonic`` in the controller)."""

    def __init__(self, build: Callable[[LoadBalanceMethod], Any], reader: Any, num_workers: int,
                 disaggregation_mode: str | None = None, *, lockstep: bool | None = None,
                 interval: float = AUTO_CHECK_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        self._build, self._reader, self._n, self._mode = build, reader, num_workers, disaggregation_mode
        self._interval, self._clock, self._log = interval, clock, logger
        # only a deployment whose auto pick depends on lockstep (no PD) has a choice to make, and only
        # when the board can say it
        self._follows = (lockstep is None and reader is not None
                         and auto_pick(disaggregation_mode, lockstep=True)
                         is not auto_pick(disaggregation_mode, lockstep=False))
        self._records = np.zeros(num_workers, DETAILED_DTYPE) if self._follows else None
        self._next = float("-inf")
        self.changes = 0
        seen = self._look() if self._follows else lockstep
        self.method = auto_pick(disaggregation_mode, lockstep=bool(seen))
        self.dispatcher = build(self.method)

    @property
    def follows_board(self) -> bool:
        """Whether ``check`` can change the method (no PD, no fixed ``lockstep``, a reader)."""
        return self._follows

    def _look(self) -> bool | None:
        seen = lockstep_on_board(self._reader, self._n, self._records)
        # nothing live yet: look again at the next check; else after the interval
        self._next = self._clock() + (self._interval if seen is not None else 0.0)
        return seen

    def check(self) -> bool:
        """Look at the board when due; True when ``auto`` changed (``dispatcher`` is then a new one)."""
        if not self._follows or self._clock() < self._next:
            return False
        seen = self._look()
        if seen is None:
            return False  # the slots went quiet: keep what they said last
        method = auto_pick(self._mode, lockstep=seen)
        if method is self.method:
            return False
        before, self.method = self.method, method
        self.dispatcher = self._build(method)
        self.changes += 1
        if self._log is not None:
            why = ("a live slot's lockstep section counts a group of more than one rank" if seen else
                   "no live slot's lockstep section counts a group of more than one rank any more")
            self._log.info("auto: method %s, was %s (%s)", self.dispatcher.described, before.value, why)
        return True
