# Types of the C extension dpboard/controller/_dispatch.c (the per-request argmin and charge).
from collections.abc import Sequence
from typing import Any

import numpy as np

class ArgminCore:
    next_start: int
    by_tokens: bool
    by_backlog: bool
    @property
    def n(self) -> int: ...
    horizon: int
    @property
    def by_headroom(self) -> bool: ...
    @property
    def by_lockstep(self) -> bool: ...
    def __init__(
        self,
        tokens: np.ndarray,
        requests: np.ndarray,
        candidate: np.ndarray,
        routable: np.ndarray,
        sent_reqs: np.ndarray,
        sent_tokens: np.ndarray,
        ring: np.ndarray | None,
        by_tokens: bool = True,
        rotate: bool = False,
        backlog: np.ndarray | None = None,
        by_backlog: bool = False,
        capacity: np.ndarray | None = None,
        by_headroom: bool = False,
        running: np.ndarray | None = None,
        chunk: np.ndarray | None = None,
        by_lockstep: bool = False,
        horizon: int = 0,
    ) -> None: ...
    def pick(self, req: Any, /) -> int: ...
    def pick_batch(self, reqs: Sequence[Any], /) -> list[int]: ...
    def pick_tokens(self, tokens: int, /) -> int: ...
    def pick_saving(self, req: Any, savings: np.ndarray, /) -> tuple[int, int]: ...
    def charge(self, rank: int, tokens: int, /) -> None: ...
    def retract(self, rank: int, tokens: int, /) -> None: ...
