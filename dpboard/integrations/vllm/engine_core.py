"""The engine side: every vLLM engine core publishes its own load into its DP rank's slot.

plugin.py's ``register()`` (the ``vllm.general_plugins`` entry point) calls ``patch()`` on
``vllm.v1.engine.core.EngineCoreProc``, the engine-core process's class (``DPEngineCoreProc``
inherits it). Nothing is read at registration: the board is opened by the engine core when its busy loop
first waits for work (``_process_input_queue``), or on its first request or step, from its own ``VllmConfig``, and only when the environment names a board
(``DPBOARD_VLLM_BOARD=NAME`` or ``DPBOARD_VLLM=1``, as for the stat logger; settings.py).

What an engine core publishes, at the end of every engine step (``_process_engine_step``), read
from its own scheduler (vllm/v1/core/sched/scheduler.py, 0.33.0):

- ``num_running_reqs``, ``num_waiting_reqs``: ``scheduler.get_request_counts()``, vLLM's own
  count (running; waiting plus those holding KV while they wait).
- ``max_total_num_tokens``: the engine's KV capacity in tokens as vLLM counts it, group-aware
  (``cache_config.kv_cache_size_tokens``, which vLLM's engine core sets from
  ``kv_cache_utils.get_kv_cache_capacity``: the blocks a request at ``max_model_len`` takes in every
  KV-cache group, so a sliding-window group counts its window, not the whole context); where vLLM
  left it unset, that same function over the scheduler's ``kv_cache_config``.
- ``num_used_tokens``: ``round(kv_cache_usage × capacity)``, with vLLM's own usage figure
  (``kv_cache_manager.usage``, the share of the block pool in use, ``SchedulerStats.kv_cache_usage``).
- ``num_total_tokens``: the used tokens plus the tokens of the prompts waiting for admission (each
  waiting request's ``num_tokens - num_computed_tokens`` as it entered its queue; waiting.py keeps
  the sum as the queues change, so a step's publish costs the same whatever the queue's length), so
  the board's backlog is the prefill work queued on the engine; the detail's
  ``num_waiting_uncached_tokens`` is the same count. vLLM looks a request's prefix up in its cache
  only when it admits it, so tokens that will be prefix-cache hits are counted here too.
- ``num_received_reqs``: ``ADD`` messages the engine core took in (``_handle_client_request``, and
  the ones its input thread answers itself with a preprocessing error), counted at intake: every
  request an API server sent that the engine has seen, whether it then runs, waits or is refused.
- the detail's ``lockstep`` section, for a MoE model's engine under data parallelism (its engine
  core keeps ``data_parallel_size`` > 1, and every engine runs each forward with the others, dummy
  batches included: ``DPEngineCoreProc``): the DP size and the step's token budget
  (``scheduler_config.max_num_batched_tokens``), what ``inflight_lockstep`` reads.

An idle engine core blocks on its input queue and runs no step; a daemon thread republishes its last
snapshot every ``HEARTBEAT_INTERVAL`` while that snapshot shows nothing running or waiting, so an
idle engine stays LIVE on the board, and one whose process is gone or stuck in a step goes STALE.

As soon as the engine core is asked to shut down (``_handle_shutdown``, which its busy loop asks
first in every round, sees a shutdown requested: SIGTERM, SIGINT, a client's; or the loop ends; or
``shutdown`` is called), it leaves its slot, saying so: the slot reads STALE from the next read on
(``BoardWriter.leave``), the heartbeat stops first under the writer's lock, and nothing publishes
into it again, so the API servers stop picking an engine that takes no new request. Then, in
``shutdown`` (which vLLM's ``run_engine_core`` calls on its way out), the last engine core of the
board to leave removes the board: vLLM starts engine cores with ``fork``, whose children never run
``atexit``. An engine core killed outright (SIGKILL, the OOM killer) loses its slot's lock with its
life; the API servers' dispatch looks at the slots' locks at every board refresh (at most every
``LOCK_CHECK_INTERVAL``, 50 ms) and leaves a slot without a writer at once (dispatch.py).

dpboard never fails an engine: an exception in the publisher is logged once, with its traceback, and
that engine core publishes no more (its slot goes STALE, so the API servers' picks leave it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpboard.board import Board, BoardWriter
from dpboard.errors import DpboardError
from dpboard.integrations.vllm import leaving as leaving_module
from dpboard.integrations.vllm import settings, waiting
from dpboard.integrations.vllm.settings import board_name, engine_slot, node_id
from dpboard.integrations.vllm.versions import SUPPORTED, Support
from dpboard.snapshot import DETAIL_DTYPE, LoadDetail, LoadSnapshot, LockstepDetail, pack_detail

log = logging.getLogger("dpboard.vllm")

STATE = "_dpboard_engine"  # the engine core's attribute holding its EnginePublisher
HEARTBEAT_INTERVAL = 0.25  # seconds; a quarter of the readers' default staleness threshold (1 s)
_opening = threading.Lock()  # the engine thread and the input thread may both open the publisher
_new_tuple = tuple.__new__  # a LoadSnapshot from its 13 values, without the keyword defaults' Python frame
# the detail's words that publish_from rewrites (8-byte words, as DETAIL_DTYPE lays them out)
_TIMESTAMP, _USAGE, _UNCACHED = (DETAIL_DTYPE.fields[f][1] // 8 for f in
                                 ("timestamp", "token_usage", "num_waiting_uncached_tokens"))


def patch(cls: type, add: Any, support: Support = SUPPORTED["0.33"]) -> None:
    """Wrap the intake, the step and the shutdown of ``cls`` (once; vLLM may load plugins again), with
    the names of ``support``'s release (versions.py: the caller has checked that ``cls`` has them)."""
    if getattr(cls, "_dpboard_patched", False):
        return
    original_intake = cls._handle_client_request
    # EngineCoreProc's input thread answers an ADD it cannot decode or preprocess (0.33: or validate)
    # itself (vllm/v1/engine/core.py, process_input_sockets), so the request never reaches the intake.
    original_errors = {name: getattr(cls, name) for name in support.input_thread_answers}
    original_step = cls._process_engine_step
    original_wait = cls._process_input_queue
    original_shutdown = cls.shutdown
    original_handle_shutdown = cls._handle_shutdown
    running = getattr(sys.modules.get(cls.__module__), "EngineShutdownState", None)
    running = getattr(running, "RUNNING", None)

    def _handle_client_request(self: Any, request_type: Any, request: Any) -> None:
        if request_type is add:
            guarded(self, EnginePublisher.count_received)
        return original_intake(self, request_type, request)

    def answered_by_input_thread(name: str) -> Any:
        original = original_errors[name]

        def counted(self: Any, request: Any, *args: Any) -> None:
            # the input thread answers this request itself: it never reaches the intake above
            guarded(self, EnginePublisher.count_received)
            return original(self, request, *args)

        counted.__name__ = name
        return counted

    def _process_engine_step(self: Any) -> bool:
        executed = original_step(self)
        guarded(self, EnginePublisher.publish_from, self.scheduler)
        return executed

    def _process_input_queue(self: Any) -> None:
        # the busy loop's first call, before an idle engine blocks on its queue: the slot from the start
        # (later calls, one per loop, find the publisher opened, or left off, and do nothing more)
        if STATE not in self.__dict__:
            guarded(self, None)
        return original_wait(self)

    def _handle_shutdown(self: Any) -> bool:
        # the busy loop asks this first in every round: once a shutdown is asked for (SIGTERM, SIGINT,
        # a client's), the engine takes no new request, so its slot says it leaves, before the loop's
        # last rounds and the teardown, while the heartbeat could still keep it LIVE
        going_on = original_handle_shutdown(self)
        if not going_on or getattr(self, "shutdown_state", running) != running:
            leave_slot(self)
        return going_on

    def shutdown(self: Any) -> None:
        leave_slot(self)  # at once: vLLM's teardown (workers, process groups) takes a while
        try:
            return original_shutdown(self)
        finally:
            leave_board(self)

    cls._handle_client_request = _handle_client_request
    cls._process_input_queue = _process_input_queue
    for name in support.input_thread_answers:
        setattr(cls, name, answered_by_input_thread(name))
    cls._process_engine_step = _process_engine_step
    cls._handle_shutdown = _handle_shutdown
    cls.shutdown = shutdown
    cls._dpboard_patched = True


def guarded(engine: Any, action: Any, *args: Any) -> None:
    """``action(publisher, *args)`` on the engine core's publisher (opened on first use; ``action``
    None only opens it). An exception is dpboard's, never the engine's: logged once with its
    traceback, and this engine core publishes no more."""
    try:
        publisher = engine_publisher(engine)
        if publisher is not None and action is not None:
            action(publisher, *args)
    except DpboardError as e:  # a setting or a board it cannot use: the message says which and the fix
        log.error("dpboard: %s; this engine core publishes no board slot and serves on", e)
        stop_publishing(engine)
    except Exception:  # a bug: its traceback
        log.exception("dpboard: the engine core's publisher failed; this engine core publishes no more "
                      "(its slot goes stale) and serves on")
        stop_publishing(engine)


def stop_publishing(engine: Any) -> None:
    publisher = engine.__dict__.get(STATE)
    engine.__dict__[STATE] = None
    if isinstance(publisher, EnginePublisher):
        try:
            publisher.close()
        except Exception:  # noqa: BLE001 - closing what already failed: nothing more to say
            pass


def leave_slot(engine: Any) -> None:
    """The engine core is on its way out (its busy loop ends, or vLLM shuts it down): its slot says so
    at once (``EnginePublisher.leave``) and nothing republishes it. Never raises into vLLM."""
    publisher = engine.__dict__.get(STATE)
    if not isinstance(publisher, EnginePublisher) or publisher.left:
        return
    try:
        publisher.leave()
    except Exception:
        log.exception("dpboard: the engine core's slot on board %r was not given up cleanly", publisher.board.name)


def leave_board(engine: Any) -> None:
    """The engine core's way out: close its publisher (giving up its slot); the last engine core of
    the board to leave removes the board. Never raises into vLLM's shutdown."""
    publisher = engine.__dict__.get(STATE)
    engine.__dict__[STATE] = None
    if not isinstance(publisher, EnginePublisher):
        return
    try:
        publisher.close(leaving=True)
    except Exception:
        log.exception("dpboard: the engine core's board %r was not closed cleanly", publisher.board.name)


def engine_publisher(engine: Any) -> EnginePublisher | None:
    """The engine core's publisher, opened on first use; None when the environment names no board."""
    publisher = engine.__dict__.get(STATE, False)
    if publisher is False:
        with _opening:
            publisher = engine.__dict__.get(STATE, False)
            if publisher is False:
                publisher = EnginePublisher.for_engine(engine.vllm_config, engine.scheduler)
                engine.__dict__[STATE] = publisher
    return publisher


class EnginePublisher:
    """One engine core's slot: what the scheduler holds, published at every step and kept live."""

    def __init__(self, board: Board, writer: BoardWriter, *, capacity_tokens: int, max_running_requests: int,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL, lockstep: LockstepDetail | None = None) -> None:
        self.board = board
        self.writer = writer
        self.rank = writer.rank
        self.capacity_tokens = max(0, int(capacity_tokens))
        self.max_running_requests = int(max_running_requests)
        self.received = 0
        self.lock = threading.Lock()  # the step and the heartbeat thread share the slot's one writer
        self.snapshot = LoadSnapshot(dp_rank=self.rank)
        # the detail as pack_detail packs it (the lockstep section fixed for the engine's life);
        # publish_from rewrites its three changing words in place
        self._detail = pack_detail(LoadDetail(max_running_requests=self.max_running_requests, lockstep=lockstep))
        raw = memoryview(self._detail.view(np.uint8))
        self._detail_floats, self._detail_ints = raw.cast("d"), raw.cast("q")
        self._queued = waiting.QueuedTokens()
        self.published_at = time.monotonic()
        self._stop = threading.Event()
        self.left = False  # the slot was given up (leave): nothing publishes into it any more
        self.heartbeat_interval = heartbeat_interval
        self._thread = threading.Thread(target=self._heartbeat, name=f"dpboard-rank{self.rank}", daemon=True)

    @classmethod
    def for_engine(cls, vllm_config: Any, scheduler: Any,
                   environ: Mapping[str, str] = os.environ) -> EnginePublisher | None:
        name = board_name(environ, getattr(vllm_config.model_config, "served_model_name", None))
        if name is None or settings.publisher(environ) != "engines":
            return None
        # not data_parallel_size/_rank: a dense model's engine core has them reset to 1 and 0 (settings.py)
        rank, n_slots = engine_slot(vllm_config.parallel_config)
        node = node_id(environ)
        board = Board.create(name, n_slots, exist_ok=True, node_id=node)
        try:
            writer = board.writer(rank, node_id=node)  # a dead predecessor's slot is taken back
        except BaseException:
            board.close()
            raise
        publisher = cls(board, writer, capacity_tokens=capacity_tokens(vllm_config, scheduler),
                        max_running_requests=getattr(vllm_config.scheduler_config, "max_num_seqs", 0) or 0,
                        lockstep=lockstep_section(vllm_config))
        publisher.publish_from(scheduler)
        publisher._thread.start()
        log.info("dpboard: engine core of DP rank %d publishes into board %r (%d slots)", rank, name, n_slots)
        return publisher

    def publish_from(self, scheduler: Any) -> None:
        """Read the scheduler and publish (the engine core's thread, after a step). No detail is packed
        per step: the publisher keeps one packed record and rewrites its three changing words."""
        running, waiting_reqs = scheduler.get_request_counts()
        usage = scheduler.kv_cache_manager.usage
        capacity = self.capacity_tokens
        used = round(usage * capacity)
        queued = self._queued(scheduler)
        words = self._detail_floats
        with self.lock:
            if self.left:
                return  # a leaving engine's last steps (a drain) are not published: it takes no new work
            self.snapshot = _new_tuple(LoadSnapshot, (self.rank, running, waiting_reqs, used, used + queued, used,
                                                      capacity, self.received, 0, 0, 0, 0, 0))
            words[_TIMESTAMP] = time.time()
            words[_USAGE] = usage
            self._detail_ints[_UNCACHED] = queued
            self._publish()

    def count_received(self) -> None:
        with self.lock:
            self.received += 1

    def _publish(self) -> None:
        self.writer.publish(self.snapshot, self._detail)
        self.published_at = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval / 2):
            with self.lock:
                if self.left or self.writer.closed:
                    return
                snap = self.snapshot
                idle = snap.num_running_reqs == 0 and snap.num_waiting_reqs == 0
                if idle and time.monotonic() - self.published_at >= self.heartbeat_interval:
                    # blocked on its input queue: the same load again. Not the requests taken in
                    # since, which the next step publishes with the queue they join.
                    self._publish()

    def leave(self) -> None:
        """Give the slot up, saying so: under the lock the heartbeat takes, the writer marks the slot
        (STALE from the next read on, ``BoardWriter.leave``) and closes, so no heartbeat or step
        publishes after it; then the heartbeat thread ends."""
        self._stop.set()
        with self.lock:
            if not self.left:
                self.left = True
                self.writer.leave()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.heartbeat_interval)

    def close(self, *, leaving: bool = False) -> None:
        """Stop publishing and give up the slot (``leave``). ``leaving`` (the engine core shuts down):
        remove the board and its records too when nothing of them lives (leaving.py). Each engine core
        gives up its slot before it looks at the others, so of engine cores leaving together the last
        one to look sees every slot given up, and removes the board."""
        self.leave()
        name = self.board.name
        self.board.close()
        if leaving:
            leaving_module.remove_if_gone(name, leaving=True)


def lockstep_section(vllm_config: Any) -> LockstepDetail | None:
    """The engine's lockstep section: a MoE model's engine core under DP keeps ``data_parallel_size``
    (a dense model's is reset to 1, settings.py ``engine_slot``) and steps with the others."""
    size = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    if size <= 1:
        return None
    budget = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0)
    return LockstepDetail(group_size=size, chunk_tokens=budget if isinstance(budget, int) and budget > 0 else 0)


def capacity_tokens(vllm_config: Any, scheduler: Any) -> int:
    """The engine's KV capacity in tokens, group-aware, as vLLM logs it ("KV cache size: N tokens")."""
    per_engine = getattr(vllm_config.cache_config, "kv_cache_size_tokens", None)
    if isinstance(per_engine, int) and per_engine > 0:
        return per_engine
    # vLLM's engine core sets it before building the scheduler (core.py, _initialize_kv_caches);
    # otherwise vLLM's own function over the scheduler's groups
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    return get_kv_cache_capacity(vllm_config, scheduler.kv_cache_config)[0]
