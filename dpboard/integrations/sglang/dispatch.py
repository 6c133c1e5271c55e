"""Opt-in (``DPBOARD_METHOD``): SGLang's DataParallelController decides with dpboard's ``Dispatcher``.

Hooks on ``DataParallelController``:

- ``__init__`` (BEFORE): DPBOARD_METHOD checked; (AFTER): the controller's ``DispatchSession``
  (``dpboard.controller.session``: its row of the dispatch record, its counts of fallbacks and
  faults) with one ``Dispatcher`` over the instance's board, with SGLang's worker slots
  (``len(self.workers)``, reserved elastic slots included) and active ranks.
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
import os
import sys
from typing import Any

from dpboard.controller import Dispatcher
from dpboard.controller.budget import request_tokens
from dpboard.controller.dispatcher import DEFAULT_REFRESH_INTERVAL, default_lockstep_horizon
from dpboard.controller.session import DispatchSession
from dpboard.errors import DpboardError, InvalidInputError
from dpboard.integrations.sglang.holding import WaveTimer
from dpboard.integrations.sglang.settings import (
    ENV_METHOD,
    ENV_WAVE_MAX_HOLD,
    ENV_WAVE_PER_RANK,
    read_settings,
)
from dpboard.integrations.sglang.transport import instance_board
from dpboard.methods import (
    METHODS,
    LoadBalanceMethod,
    parse_load_balance_method,
    resolve_load_balance_method,
)

logger = logging.getLogger("dpboard.sglang")

# the controller's attribute holding its DispatchSession: the Dispatcher, the dispatch record's row,
# the counts of fallbacks (``fallbacks``) and of exceptions in dpboard's pick or accounting (``faults``)
STATE = "_dpboard_dispatch"
LOAD_AWARE = ("TOTAL_TOKENS", "TOTAL_REQUESTS")
_module_name = "sglang.srt.managers.data_parallel_controller"
_ticks = False  # the loop's receive is hooked for a hold (a holding DPBOARD_METHOD at the plugin's load)
_timer: WaveTimer | None = None  # the holding controller of this process (SGLang runs one)
# the loop's receive socket and its session: each turn of the loop is the session's turn (SGLang runs one)
_turns: tuple[Any, DispatchSession] | None = None


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
    global _ticks
    raw_method = os.environ.get(ENV_METHOD, "")
    if raw_method.strip():  # dpboard dispatches: each turn of the loop brings the record up to date
        registry.register(f"{module_name}.sock_recv", look_again, hook_type.AROUND)
    if _holds(raw_method):  # only then: what is held goes before a control message
        registry.register(f"{cls}.send_to_all_workers", flush_held, hook_type.BEFORE)
        registry.register(f"{cls}.send_control_message", flush_held, hook_type.BEFORE)
        _ticks = True


def _holds(raw_method: str) -> bool:
    """Whether DPBOARD_METHOD names a method that holds requests (a bad name holds nothing here: the
    controller refuses it at its start)."""
    try:
        method = parse_load_balance_method(raw_method.strip())
    except InvalidInputError:
        return False
    return isinstance(method, LoadBalanceMethod) and METHODS[method].holds


def check_settings(controller: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``DataParallelController.__init__``: refuse a bad DPBOARD_METHOD, or one SGLang would never
    call, before the controller opens a socket or starts a scheduler."""
    settings = read_settings()
    if settings.method is None:
        return None
    module = sys.modules[_module_name]
    sglang_method = module.get_parallel().load_balance_method.lower()
    if sglang_method.upper() not in LOAD_AWARE:
        raise InvalidInputError(
            f"{ENV_METHOD}={settings.method} needs SGLang's --load-balance-method total_tokens or "
            f"total_requests (SGLang calls its load-aware dispatch only then), got {sglang_method}: "
            f"add --load-balance-method total_tokens, or unset {ENV_METHOD}")
    mode = module.get_disagg().disaggregation_mode
    if METHODS[resolve_load_balance_method(settings.method, mode)].holds and not _ticks:
        # the loop's receive is hooked at the plugin's load, from DPBOARD_METHOD as it was then
        raise InvalidInputError(
            f"{ENV_METHOD}={settings.method} holds requests for waves, but the plugin was loaded in this process "
            f"without a holding {ENV_METHOD}, so nothing would look at them again: set {ENV_METHOD} before "
            f"SGLang starts")
    if resolve_load_balance_method(settings.method, mode) is LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM and mode != "prefill":
        # Only a PD prefill server's requests carry the room this method maps to a rank.
        raise InvalidInputError(
            f"{ENV_METHOD}={settings.method} needs PD disaggregation (--disaggregation-mode prefill), where "
            f"requests carry a bootstrap_room; this server runs disaggregation mode {mode!r}: pick a "
            f"load-aware method (e.g. {ENV_METHOD}=inflight_tokens), or unset {ENV_METHOD}")
    return None


def attach_dispatcher(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``DataParallelController.__init__``: the controller's Dispatcher."""
    settings = read_settings()
    if settings.method is None:
        return None
    module = sys.modules[_module_name]
    num_dp_ranks = module.get_parallel().num_dp_ranks
    board = instance_board(controller.port_args, num_dp_ranks)
    num_workers = len(controller.workers)
    mode = module.get_disagg().disaggregation_mode
    lockstep = _dp_attention(module)  # DPBOARD_METHOD=auto under --enable-dp-attention: inflight_lockstep
    method = resolve_load_balance_method(settings.method, mode, lockstep=lockstep)
    session = DispatchSession.with_record(board.name, num_workers, method=method.value, mode=mode,
                                          refresh_interval=DEFAULT_REFRESH_INTERVAL, logger=logger,
                                          own_path="SGLang's own dispatch", fallback_path="the pick SGLang's budget would make")
    # a scheduler that died is left at once; SGLang's reserved elastic-EP slots read as EMPTY
    reader = session.reader(board.reader(stale_after=settings.stale_after), locks=board.slot_locks(),
                            num_workers=num_workers)
    dispatcher = Dispatcher(settings.method, num_workers, reader=reader, active=controller._active_workers,
                            disaggregation_mode=mode, lockstep=lockstep,
                            lockstep_horizon=default_lockstep_horizon(_prefill_delayer(mode)),
                            wave_max_hold=settings.wave_max_hold, wave_per_rank=settings.wave_per_rank)
    session.use(dispatcher)
    setattr(controller, STATE, session)
    global _timer, _turns
    _timer = WaveTimer(controller, session, _module_name, _fallback_pick) if dispatcher.holds else None
    _turns = (getattr(controller, "recv_from_tokenizer", None), session)
    _sync(controller, dispatcher)
    logger.info("dpboard: DP dispatch by %s over board %r (%d worker slots)", dispatcher.described, board.name,
                num_workers)
    if dispatcher.holds:
        logger.info("dpboard: arrivals held while the group decodes, %d per rank fill a wave, none longer than "
                    "%g s less a group step (%s, %s)", settings.wave_per_rank, settings.wave_max_hold,
                    ENV_WAVE_PER_RANK, ENV_WAVE_MAX_HOLD)
    return None


def _dp_attention(module: Any) -> bool:
    """Whether this server runs DP attention (its ranks step in lockstep)."""
    try:
        return bool(module.get_parallel().attn_dp_enabled)
    except Exception:  # an SGLang without the flag: as without DP attention
        return False


def _prefill_delayer(mode: str) -> bool:
    """Whether this server's schedulers run SGLang's prefill delayer (``--enable-prefill-delayer``;
    a PD decode server ignores it, as SGLang's scheduler does)."""
    if mode == "decode":
        return False
    try:
        from sglang.srt.runtime_context import get_schedule

        return bool(get_schedule().enable_prefill_delayer)
    except Exception:  # an SGLang without the flag, or a context without it: as without the delayer
        return False


def dispatch_request(original: Any, controller: Any, req: Any) -> None:
    """AROUND ``total_tokens_scheduler`` / ``total_requests_scheduler``."""
    session: DispatchSession | None = getattr(controller, STATE, None)
    if session is None:
        return original(controller, req)
    try:
        routed = controller.maybe_external_dp_rank_routing(req)
    except ValueError:  # SGLang refuses a routed rank that is not active
        session.rejected()
        raise
    if routed:
        try:
            session.routed(req.routed_dp_rank, request_tokens(req))
        except Exception as e:  # SGLang sent it already: the count is dpboard's, the request is fine
            session.fault(e, getattr(req, "rid", "?"), placed=False)
        return None
    timer = _timer
    if timer is not None and timer.controller is controller:
        timer.offer(req, original)
        return None
    dispatcher = session.dispatcher
    try:
        try:
            rank = dispatcher.dispatch(req)
        except DpboardError as e:
            # Never into SGLang's loop: an error there stops the controller and, through SIGQUIT to its
            # parent, the whole server. SGLang's own budget always picks a rank; so does the fallback.
            rank = _fallback_pick(controller, session, req, e)
    except Exception as e:  # a bug in dpboard's pick: SGLang's own dispatch places the request
        session.fault(e, getattr(req, "rid", "?"))
        return original(controller, req)
    try:
        sys.modules[_module_name].sock_send(controller.workers[rank], req)
    except BaseException:
        dispatcher.retract(rank, req)
        raise
    try:
        session.picked(rank, with_room=getattr(req, "bootstrap_room", None) is not None)
    except Exception as e:  # sent already: only the record's count is lost
        session.fault(e, getattr(req, "rid", "?"), placed=False)
    return None


def _fallback_pick(controller: Any, session: DispatchSession, req: Any, why: DpboardError) -> int:
    """The rank SGLang's budget would pick when the dispatcher has none (no live rank: one long step
    stalled every rank past DPBOARD_STALE_AFTER; a request the method cannot place): the least
    loaded by the dispatcher's last-known loads among SGLang's available active workers, whatever
    their staleness, charged to the dispatcher. Counted and logged by the session (``fallback``)."""
    count = session.fallback(why, getattr(req, "rid", "?"))
    dispatcher = session.dispatcher
    n = dispatcher.num_workers
    active = [r for r in controller._active_workers if 0 <= r < n and controller.workers[r] is not None]
    ranks = [r for r in active if r < len(controller.status) and controller.status[r]] or active
    if not ranks:
        ranks = [r for r in range(min(n, len(controller.workers))) if controller.workers[r] is not None] or [0]
    budget = dispatcher.budget
    if budget is None:  # round robin or room: SGLang's round robin over what is there
        return ranks[count % len(ranks)]
    tokens, requests = budget.total_tokens, budget.total_requests
    rank = min(ranks, key=lambda r: (int(tokens[r]), int(requests[r])))
    try:
        budget.charge(rank, request_tokens(req))
    except DpboardError:
        budget.charge(rank, 0)  # a request whose size is not known: counted, not weighed
    return rank


def look_again(original: Any, socket: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND the DP controller module's ``sock_recv``: at each turn of the controller's loop, the held
    wave that is due goes out before the next receive (holding.py), and the counts that changed since
    the dispatch record's last publish go into it once it is due (an idle controller's last picks
    reach ``dpboard doctor`` within 0.1 s; one comparison on most turns)."""
    timer = _timer
    if timer is not None and socket is timer.socket:
        timer.tick()
    turns = _turns
    if turns is not None and socket is turns[0]:
        turns[1].turn()
    return original(socket, *args, **kwargs)


def flush_held(controller: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``send_to_all_workers`` / ``send_control_message``: what is held goes first."""
    timer = _timer
    if timer is not None and timer.controller is controller:
        timer.flush()
    return None


def refresh_load_budget(original: Any, controller: Any) -> None:
    """AROUND ``refresh_load_budget``: SGLang's budget is not used while the Dispatcher decides."""
    if getattr(controller, STATE, None) is None:
        return original(controller)
    return None


def sync_active(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``update_active_ranks`` / ``_refresh_active_workers``."""
    session = getattr(controller, STATE, None)
    if session is not None:
        _sync(controller, session.dispatcher)
    return None


def _sync(controller: Any, dispatcher: Dispatcher) -> None:
    dispatcher.set_active(controller._active_workers)
    for rank, available in enumerate(controller.status):
        if rank < dispatcher.num_workers:
            dispatcher.set_status(rank, bool(available))
