"""Dispatch: which DP rank gets each request (docs/DISPATCH.md), and the ZMQ controller process around it.

The pure parts (budget, dispatcher) import NumPy and a small C extension only; the ZMQ process
(``DataParallelController``) is imported on first use. The method table they read is the leaf
``dpboard.methods`` (re-exported here: ``LoadBalanceMethod``, ``resolve_load_balance_method``, ...).
"""

from __future__ import annotations

from typing import Any

from dpboard.controller.budget import DPBudget
from dpboard.controller.dispatcher import Dispatcher
from dpboard.methods import (
    LoadBalanceMethod,
    ReaderOwner,
    resolve_load_balance_method,
    zmq_reader_owner,
)

__all__ = [
    "DPBudget",
    "DataParallelController",
    "Dispatcher",
    "LoadBalanceMethod",
    "ReaderOwner",
    "resolve_load_balance_method",
    "zmq_reader_owner",
]


def __getattr__(name: str) -> Any:
    if name == "DataParallelController":
        from dpboard.controller.process import DataParallelController

        return DataParallelController
    raise AttributeError(f"module 'dpboard.controller' has no attribute {name!r}")
