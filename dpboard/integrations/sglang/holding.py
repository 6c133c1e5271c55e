"""``inflight_wave`` inside SGLang's DP controller: the controller's own loop is the hold's timer.

``DataParallelController.event_loop`` turns without pause: each turn feeds its soft watchdog and
asks ``sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)`` for the next request
(data_parallel_controller.py:927-935 in SGLang 0.5.23). With a holding DPBOARD_METHOD the plugin
wraps that call (AROUND, registered only then): a turn past ``Dispatcher.next_due_at`` places the
wave that is due before it receives; any other turn costs one clock read. A held request leaves:

- with its wave (``Dispatcher.due``: the wave is full, the group no longer decodes, or the oldest
  has been held its bound);
- before any message the controller forwards to the schedulers (``send_to_all_workers``,
  ``send_control_message``: an abort, a cache flush, SGLang's ``ShutdownReq``), so that none of them
  overtakes a request the tokenizer sent before it, as without the hold;
- at SIGTERM, by SGLang's own drain: the tokenizer waits for every request it has sent, the held
  ones too, before it stops the controller, whose loop turns on meanwhile.

A wave is placed by ``Dispatcher.dispatch_batch`` (inflight_lockstep's pick, for the batch) and
SGLang's ``sock_send``. No dpboard error reaches SGLang's loop: a DpboardError takes dispatch.py's
fallback pick, any other exception (a bug) sends the wave through SGLang's own dispatch, counted
and logged at the 1st, 10th, 100th... time (``DispatchSession.fault``). A send that fails stops the
controller as SGLang's own failed send does, with the rank named.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from dpboard.controller.session import DispatchSession
from dpboard.errors import DpboardError

IO_STRUCT = "sglang.srt.managers.io_struct"  # loaded by the DP controller's module
# SGLang's own dispatch of one request (the unhooked ``total_tokens_scheduler``, say): (controller, req)
OwnDispatch = Callable[[Any, Any], None]
FallbackPick = Callable[[Any, DispatchSession, Any, DpboardError], int]


class WaveTimer:
    """One DP controller's held requests: offered as they come, placed when their wave is due."""

    __slots__ = ("controller", "session", "socket", "own", "due_at", "_module", "_fallback", "_clock")

    def __init__(self, controller: Any, session: DispatchSession, module_name: str, fallback: FallbackPick):
        self.controller = controller
        self.session = session
        self.socket = getattr(controller, "recv_from_tokenizer", None)  # the loop's receive; no other
        self.own: OwnDispatch | None = None  # set by the first offer, before anything is held
        self.due_at = math.inf  # the dispatcher's clock: when the loop should place a wave
        self._module = module_name
        self._fallback = fallback
        self._clock = session.dispatcher.clock

    def offer(self, req: Any, own: OwnDispatch) -> None:
        """A request the controller would dispatch now: held, or placed with what its wave releases."""
        self.own = own
        try:
            reqs = self.session.dispatcher.offer([req])
        except Exception as e:  # a bug in the hold: this request goes by SGLang's own path
            self.session.fault(e, getattr(req, "rid", "?"))
            own(self.controller, req)
            reqs = []
        self.place(reqs)
        self._rearm()

    def tick(self) -> None:
        """A turn of the controller's loop: the wave that is due, if one is."""
        if self._clock() < self.due_at:
            return
        try:
            reqs = self.session.dispatcher.due()
        except Exception as e:  # a bug in the rule: nothing may stay held behind it
            self.session.fault(e, "a held wave", placed=False)
            reqs = self.session.dispatcher.release_all()
        self.place(reqs)
        self._rearm()

    def flush(self, *args: Any, **kwargs: Any) -> None:
        """BEFORE a message the controller forwards to its schedulers: what is held goes first."""
        self.place(self.session.dispatcher.release_all("order"))
        self._rearm()

    def place(self, reqs: list[Any]) -> None:
        """Send ``reqs`` to the ranks ``dispatch_batch`` picks for them (see the module's text)."""
        if not reqs:
            return
        module = sys.modules[self._module]
        for req in reqs:
            _rewrap_time_stats(req)
        controller, session = self.controller, self.session
        dispatcher = session.dispatcher
        try:
            try:
                ranks = dispatcher.dispatch_batch(reqs)
            except DpboardError as e:
                ranks = [self._fallback(controller, session, req, e) for req in reqs]
        except Exception as e:  # a bug in the pick: SGLang's own dispatch places the wave
            for req in reqs:
                session.fault(e, getattr(req, "rid", "?"))
                self.own(controller, req)
            return
        picks = list(zip(ranks, reqs, strict=True))
        for i, (rank, req) in enumerate(picks):
            try:
                module.sock_send(controller.workers[rank], req)
            except BaseException as e:
                for unsent_rank, unsent in reversed(picks[i:]):
                    dispatcher.retract(unsent_rank, unsent)  # latest first: what retract undoes exactly
                # Not a zmq error: the loop's receive would take one for "nothing to receive" and go on.
                raise RuntimeError(f"dpboard: sending a held request to DP rank {rank} failed: {e!r}") from e
            try:
                session.picked(rank, with_room=getattr(req, "bootstrap_room", None) is not None)
            except Exception as e:  # sent already: only the record's count is lost
                session.fault(e, getattr(req, "rid", "?"), placed=False)

    def _rearm(self) -> None:
        try:
            due = self.session.dispatcher.next_due_at()
        except Exception as e:  # look again at the next turn rather than never
            self.session.fault(e, "a held wave", placed=False)
            due = self._clock()
        self.due_at = math.inf if due is None else due


def _rewrap_time_stats(req: Any) -> None:
    """SGLang wraps a request's time stats for the wire only while it dispatches it, and unwraps them
    once its dispatch returns (``dispatching_with_trace``): a request held past that is wrapped
    again, as SGLang's send expects (a no-op under SGLANG_USE_PICKLE_IPC)."""
    io_struct = sys.modules[IO_STRUCT]
    stats = getattr(req, "time_stats", None)
    if stats is not None and not isinstance(stats, io_struct.PickleWrapper):
        req.time_stats = io_struct.wrap_as_pickle(stats)
