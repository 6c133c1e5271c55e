"""Opt-in (``DPBOARD_METHOD``): SGLang's DataParallelController decides with dpboard's ``Dispatcher``.

Hooks on ``DataParallelController``:

- ``__init__`` (BEFORE): DPBOARD_METHOD checked; (AFTER): one ``Dispatcher`` for the controller, over the instance's board, with
  SGLang's worker slots (``len(self.workers)``, reserved elastic slots included) and active ranks.
- ``total_tokens_scheduler`` / ``total_requests_scheduler`` (AROUND): SGLang's
  ``maybe_external_dp_rank_routing`` first (its check and its send, unchanged; the pick is then
  charged to the dispatcher so its in-flight count stays exact), else the dispatcher's rank, sent
  with SGLang's ``sock_send``. Health checks never get here: SGLang routes them itself.
- ``refresh_load_budget`` (AROUND): nothing to do; the dispatcher reads the board itself, at most
  once per 20 ms (SGLang's throttle), straight from the slots.
- ``update_active_ranks`` and ``_refresh_active_workers`` (AFTER): SGLang's active ranks and worker
  status, mirrored into the dispatcher.

SGLang reaches the two load-aware methods only when its own ``--load-balance-method`` is
``total_tokens`` or ``total_requests``; with another, the controller refuses to start (before it
opens anything) rather than ignore DPBOARD_METHOD.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

from dpboard.board import BoardReader
from dpboard.controller import Dispatcher
from dpboard.controller.budget import request_tokens
from dpboard.errors import InvalidInputError
from dpboard.integrations.sglang.settings import ENV_METHOD, read_settings
from dpboard.integrations.sglang.transport import instance_board
from dpboard.snapshot import SNAPSHOT_DTYPE

logger = logging.getLogger("dpboard.sglang")

STATE = "_dpboard_dispatch"  # the controller's attribute holding its Dispatcher
LOAD_AWARE = ("TOTAL_TOKENS", "TOTAL_REQUESTS")
_module_name = "sglang.srt.managers.data_parallel_controller"


def register(registry: Any, hook_type: Any, module_name: str) -> None:
    global _module_name
    _module_name = module_name
    cls = f"{module_name}.DataParallelController"
    registry.register(f"{cls}.__init__", check_settings, hook_type.BEFORE)
    registry.register(f"{cls}.__init__", attach_dispatcher, hook_type.AFTER)
    registry.register(f"{cls}.total_tokens_scheduler", dispatch_request, hook_type.AROUND)
    registry.register(f"{cls}.total_requests_scheduler", dispatch_request, hook_type.AROUND)
    registry.register(f"{cls}.refresh_load_budget", refresh_load_budget, hook_type.AROUND)
    registry.register(f"{cls}.update_active_ranks", sync_active, hook_type.AFTER)
    registry.register(f"{cls}._refresh_active_workers", sync_active, hook_type.AFTER)


class _PaddedReader:
    """A board reader for more worker slots than the board has (SGLang's reserved elastic-EP slots,
    which publish nothing): the board's records, then EMPTY ones."""

    def __init__(self, reader: BoardReader, n: int):
        self._reader = reader
        self._records = np.zeros(n, SNAPSHOT_DTYPE)
        self._records["dp_rank"] = np.arange(n)
        self._board_slots = reader.n_slots

    def read_array(self, out: np.ndarray | None = None) -> np.ndarray:
        out = self._records if out is None else out
        self._reader.read_array(out[: self._board_slots])
        return out


def check_settings(controller: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``DataParallelController.__init__``: refuse a bad DPBOARD_METHOD, or one SGLang would never
    call, before the controller opens a socket or starts a scheduler."""
    settings = read_settings()
    if settings.method is None:
        return None
    sglang_method = sys.modules[_module_name].get_parallel().load_balance_method.lower()
    if sglang_method.upper() not in LOAD_AWARE:
        raise InvalidInputError(
            f"{ENV_METHOD}={settings.method} needs SGLang's --load-balance-method total_tokens or "
            f"total_requests (SGLang calls its load-aware dispatch only then), got {sglang_method}: "
            f"add --load-balance-method total_tokens, or unset {ENV_METHOD}")
    return None


def attach_dispatcher(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``DataParallelController.__init__``: the controller's Dispatcher."""
    settings = read_settings()
    if settings.method is None:
        return None
    module = sys.modules[_module_name]
    num_dp_ranks = module.get_parallel().num_dp_ranks
    board = instance_board(controller.port_args, num_dp_ranks)
    reader: Any = board.reader(stale_after=settings.stale_after)
    num_workers = len(controller.workers)
    if num_workers > board.n_slots:
        reader = _PaddedReader(reader, num_workers)
    dispatcher = Dispatcher(settings.method, num_workers, reader=reader, active=controller._active_workers,
                            disaggregation_mode=module.get_disagg().disaggregation_mode)
    setattr(controller, STATE, dispatcher)
    _sync(controller, dispatcher)
    logger.info("dpboard: DP dispatch by %s over board %r (%d worker slots)", dispatcher.method, board.name,
                num_workers)
    return None


def dispatch_request(original: Any, controller: Any, req: Any) -> None:
    """AROUND ``total_tokens_scheduler`` / ``total_requests_scheduler``."""
    dispatcher: Dispatcher | None = getattr(controller, STATE, None)
    if dispatcher is None:
        return original(controller, req)
    if controller.maybe_external_dp_rank_routing(req):
        if dispatcher.budget is not None:
            dispatcher.budget.charge(req.routed_dp_rank, request_tokens(req))
        return None
    rank = dispatcher.dispatch(req)
    try:
        sys.modules[_module_name].sock_send(controller.workers[rank], req)
    except BaseException:
        dispatcher.retract(rank, req)
        raise
    return None


def refresh_load_budget(original: Any, controller: Any) -> None:
    """AROUND ``refresh_load_budget``: SGLang's budget is not used while the Dispatcher decides."""
    if getattr(controller, STATE, None) is None:
        return original(controller)
    return None


def sync_active(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``update_active_ranks`` / ``_refresh_active_workers``."""
    dispatcher = getattr(controller, STATE, None)
    if dispatcher is not None:
        _sync(controller, dispatcher)
    return None


def _sync(controller: Any, dispatcher: Dispatcher) -> None:
    dispatcher.set_active(controller._active_workers)
    for rank, available in enumerate(controller.status):
        if rank < dispatcher.num_workers:
            dispatcher.set_status(rank, bool(available))
