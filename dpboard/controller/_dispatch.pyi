# Types of the C extension dpboard/controller/_dispatch.c (the per-request argmin and charge).
# Its arguments and rules are PyArgminCore's (dpboard/controller/budget.py), its Python twin.
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_REQUEST_TOKENS: int
# the argmin keys: dpboard.controller.methods.ArgminKey's values (compared at import)
KEY_REQUESTS: int
KEY_TOKENS: int
KEY_BACKLOG: int
KEY_HEADROOM: int
KEY_LOCKSTEP: int

class ArgminCore:
    next_start: int
    key: int
    horizon: int
    @property
    def n(self) -> int: ...
    def __init__(self, arrays: Any, key: int = ..., rotate: bool = ..., horizon: int = ...) -> None: ...
    def pick(self, req: Any, /) -> int: ...
    def pick_batch(self, reqs: Sequence[Any], /) -> list[int]: ...
    def pick_tokens(self, tokens: int, /) -> int: ...
    def pick_saving(self, req: Any, savings: np.ndarray, /) -> tuple[int, int]: ...
    def charge(self, rank: int, tokens: int, /) -> None: ...
    def retract(self, rank: int, tokens: int, /) -> None: ...
