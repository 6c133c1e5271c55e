"""The prefill waiting in a vLLM scheduler's queues, kept as the queues change, so that reading it
costs the same at 10 requests waiting as at 10,000.

vLLM 0.33.0's scheduler keeps its waiting requests in two ``RequestQueue`` objects,
``scheduler.waiting`` and ``scheduler.kv_holding_waiting`` (vllm/v1/core/sched/request_queue.py: a
``deque`` for ``fcfs``, a heap for ``priority``, whose iteration copies and pops the heap). Every
change the scheduler makes to them goes through the queue's own methods (``add_request``,
``prepend_request(s)``, ``pop_request``, ``remove_request(s)``). ``count(queue)`` gives the queue
object, in place, a direct subclass of the queue's class that runs each of those methods unchanged
and keeps beside it each queued request's remaining prefill as it entered
(``num_tokens - num_computed_tokens``) and their sum. Reading the sum is O(1); the queue's object,
its contents and its order are vLLM's.

A request's figure is the one it had when it entered the queue. vLLM changes a queued request's
tokens in place only where a KV connector loads its KV asynchronously or a streaming-input session
gets its next chunk; such a request keeps its entry figure until it leaves the queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TOKENS = "_dpboard_tokens"  # request -> the prefill it had when it entered the queue
TOTAL = "_dpboard_total"
_classes: dict[type, type] = {}


def remaining(request: Any) -> int:
    return max(0, request.num_tokens - request.num_computed_tokens)


def _enter(queue: Any, request: Any) -> None:
    tokens = queue.__dict__[TOKENS]
    value = remaining(request)
    queue.__dict__[TOTAL] += value - tokens.get(request, 0)
    tokens[request] = value


def _leave(queue: Any, request: Any) -> None:
    value = queue.__dict__[TOKENS].pop(request, None)
    if value is not None:
        queue.__dict__[TOTAL] -= value


def counted_class(base: type) -> type:
    """``base`` (a vLLM ``RequestQueue`` class) with the sum kept beside each of its methods. A
    direct subclass, so that an existing queue can take it in place (``__class__``)."""
    cls = _classes.get(base)
    if cls is not None:
        return cls

    class Counted(base):  # type: ignore[valid-type, misc]
        def add_request(self, request: Any) -> None:
            super().add_request(request)
            _enter(self, request)

        def prepend_request(self, request: Any) -> None:
            super().prepend_request(request)
            _enter(self, request)

        def prepend_requests(self, requests: Iterable[Any]) -> None:
            requests = requests if isinstance(requests, (list, tuple)) else list(requests)
            super().prepend_requests(requests)
            for request in requests:  # the heap's prepend adds each one: entering twice counts once
                _enter(self, request)

        def pop_request(self) -> Any:
            request = super().pop_request()
            _leave(self, request)
            return request

        def remove_request(self, request: Any) -> None:
            super().remove_request(request)
            _leave(self, request)

        def remove_requests(self, requests: Iterable[Any]) -> None:
            requests = requests if isinstance(requests, (list, tuple, set, frozenset)) else list(requests)
            super().remove_requests(requests)
            for request in requests:
                _leave(self, request)

        def queued_tokens(self) -> int:
            if len(self.__dict__[TOKENS]) != len(self):  # changed behind the methods above: count again
                recount(self)
            return self.__dict__[TOTAL]

    Counted.__name__ = Counted.__qualname__ = f"Counted{base.__name__}"
    _classes[base] = Counted
    return Counted


def recount(queue: Any) -> None:
    """One walk of the queue (vLLM's own iteration), the figures taken afresh."""
    members = list(queue._heap) if hasattr(queue, "_heap") else list(queue)
    tokens = {request: remaining(request) for request in members}
    queue.__dict__[TOKENS] = tokens
    queue.__dict__[TOTAL] = sum(tokens.values())


def count(queue: Any) -> Any | None:
    """Give ``queue`` (a vLLM ``RequestQueue``) its counted class, in place; once. None for a queue
    that cannot take it (another scheduler's, without an instance ``__dict__`` or of a built-in type)."""
    if TOTAL in getattr(queue, "__dict__", ()):
        return queue
    try:
        cls = counted_class(type(queue))
        queue.__dict__[TOKENS], queue.__dict__[TOTAL] = {}, 0
        queue.__class__ = cls
    except (AttributeError, TypeError):
        for key in (TOKENS, TOTAL):
            getattr(queue, "__dict__", {}).pop(key, None)
        return None
    recount(queue)  # after the class: a request another thread adds meanwhile is in the walk
    return queue


def queued_tokens(scheduler: Any) -> int:
    """The prefill still to do of the requests waiting in ``scheduler``'s two queues (a walk of a
    queue that ``count`` cannot keep)."""
    total = 0
    for name in ("waiting", "kv_holding_waiting"):
        queue = getattr(scheduler, name, None)
        if queue is None:
            continue
        counted = count(queue)
        total += counted.queued_tokens() if counted is not None else sum(remaining(r) for r in queue)
    return total


class QueuedTokens:
    """``queued_tokens`` of one scheduler at every step, its two queues looked up and counted once:
    while the scheduler keeps the same two counted queue objects, a call is their two sums."""

    __slots__ = ("_waiting", "_holding")
    _NONE = object()  # no queues counted yet

    def __init__(self) -> None:
        self._waiting: Any = self._NONE
        self._holding: Any = self._NONE

    def __call__(self, scheduler: Any) -> int:
        waiting = getattr(scheduler, "waiting", None)
        holding = getattr(scheduler, "kv_holding_waiting", None)
        if waiting is self._waiting and holding is self._holding:
            return waiting.queued_tokens() + holding.queued_tokens()
        total = queued_tokens(scheduler)  # counts each queue it can
        if waiting is not None and holding is not None and count(waiting) is not None and count(holding) is not None:
            self._waiting, self._holding = waiting, holding
        return total


def walk(scheduler: Any) -> int:
    """The same figure by a walk of every waiting request (what each step cost before ``count``)."""
    return sum(remaining(request) for name in ("waiting", "kv_holding_waiting")
               for request in getattr(scheduler, name, ()))
