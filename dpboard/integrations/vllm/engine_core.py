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
- ``num_used_tokens`` / ``max_total_num_tokens``: blocks in use and blocks usable in the scheduler's
  block pool (``block_pool.num_gpu_blocks`` less vLLM's null block, less the free queue), times
  the block size: the share is exactly ``block_pool.get_usage()``.
- ``num_total_tokens``: the used tokens plus the tokens of the prompts waiting for admission (each
  waiting request's ``num_tokens - num_computed_tokens``), so the board's backlog is the prefill
  work queued on the engine; the detail's ``num_waiting_uncached_tokens`` is the same count.
- ``num_received_reqs``: ``ADD`` messages the engine core took in (``_handle_client_request``, and
  the ones its input thread answers itself with a preprocessing error), counted at intake: every
  request an API server sent that the engine has seen, whether it then runs, waits or is refused.

An idle engine core blocks on its input queue and runs no step; a daemon thread republishes its last
snapshot every ``HEARTBEAT_INTERVAL`` while that snapshot shows nothing running or waiting, so an
idle engine stays LIVE on the board, and one whose process is gone or stuck in a step goes STALE.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from dpboard.board import Board, BoardWriter
from dpboard.integrations.vllm import settings
from dpboard.integrations.vllm.settings import board_name, engine_slot, node_id
from dpboard.snapshot import LoadDetail, LoadSnapshot

log = logging.getLogger("dpboard.vllm")

# EngineCoreProc's input thread answers an ADD it cannot decode or preprocess with one of these
# (vllm/v1/engine/core.py, process_input_sockets), so the request never reaches the intake.
INPUT_THREAD_ANSWERS = ("_handle_request_preproc_error", "_handle_request_validation_error")
STATE = "_dpboard_engine"  # the engine core's attribute holding its EnginePublisher
HEARTBEAT_INTERVAL = 0.25  # seconds; a quarter of the readers' default staleness threshold (1 s)
_opening = threading.Lock()  # the engine thread and the input thread may both open the publisher


def patch(cls: type, add: Any) -> None:
    """Wrap the intake and the step of ``cls`` (once; vLLM may load plugins again)."""
    if getattr(cls, "_dpboard_patched", False):
        return
    original_intake = cls._handle_client_request
    original_errors = {name: getattr(cls, name) for name in INPUT_THREAD_ANSWERS}
    original_step = cls._process_engine_step
    original_wait = cls._process_input_queue

    def _handle_client_request(self: Any, request_type: Any, request: Any) -> None:
        if request_type is add:
            publisher = engine_publisher(self)
            if publisher is not None:
                publisher.count_received()
        return original_intake(self, request_type, request)

    def answered_by_input_thread(name: str) -> Any:
        original = original_errors[name]

        def counted(self: Any, request: Any, *args: Any) -> None:
            # the input thread answers this request itself: it never reaches the intake above
            publisher = engine_publisher(self)
            if publisher is not None:
                publisher.count_received()
            return original(self, request, *args)

        counted.__name__ = name
        return counted

    def _process_engine_step(self: Any) -> bool:
        executed = original_step(self)
        publisher = engine_publisher(self)
        if publisher is not None:
            publisher.publish_from(self.scheduler)
        return executed

    def _process_input_queue(self: Any) -> None:
        # the busy loop's first call, before an idle engine blocks on its queue: the slot from the start
        engine_publisher(self)
        return original_wait(self)

    cls._handle_client_request = _handle_client_request
    cls._process_input_queue = _process_input_queue
    for name in INPUT_THREAD_ANSWERS:
        setattr(cls, name, answered_by_input_thread(name))
    cls._process_engine_step = _process_engine_step
    cls._dpboard_patched = True


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

    def __init__(self, board: Board, writer: BoardWriter, *, block_size: int, max_running_requests: int,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL) -> None:
        self.board = board
        self.writer = writer
        self.rank = writer.rank
        self.block_size = max(1, int(block_size))
        self.max_running_requests = int(max_running_requests)
        self.received = 0
        self.lock = threading.Lock()  # the step and the heartbeat thread share the slot's one writer
        self.snapshot = LoadSnapshot(dp_rank=self.rank)
        self.detail = LoadDetail(max_running_requests=self.max_running_requests)
        self.published_at = time.monotonic()
        self._stop = threading.Event()
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
        publisher = cls(board, writer, block_size=scheduler.block_size,
                        max_running_requests=getattr(vllm_config.scheduler_config, "max_num_seqs", 0) or 0)
        publisher.publish_from(scheduler)
        publisher._thread.start()
        log.info("dpboard: engine core of DP rank %d publishes into board %r (%d slots)", rank, name, n_slots)
        return publisher

    def publish_from(self, scheduler: Any) -> None:
        """Read the scheduler and publish (the engine core's thread, after a step)."""
        running, waiting = scheduler.get_request_counts()
        pool = scheduler.kv_cache_manager.block_pool
        usable = max(0, pool.num_gpu_blocks - 1)  # the null block is never free nor usable
        used_blocks = max(0, usable - pool.get_num_free_blocks())
        used = used_blocks * self.block_size
        queued = waiting_tokens(scheduler)
        with self.lock:
            self.snapshot = LoadSnapshot(
                dp_rank=self.rank, num_running_reqs=running, num_waiting_reqs=waiting,
                num_used_tokens=used, num_total_tokens=used + queued, num_active_tokens=used,
                max_total_num_tokens=usable * self.block_size, num_received_reqs=self.received,
            )
            self.detail = LoadDetail(
                timestamp=time.time(), num_waiting_uncached_tokens=queued,
                max_running_requests=self.max_running_requests,
                token_usage=used_blocks / usable if usable else 0.0,
            )
            self._publish()

    def count_received(self) -> None:
        with self.lock:
            self.received += 1

    def _publish(self) -> None:
        self.writer.publish_detailed(self.snapshot, self.detail)
        self.published_at = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval / 2):
            with self.lock:
                if self.writer.closed:
                    return
                snap = self.snapshot
                idle = snap.num_running_reqs == 0 and snap.num_waiting_reqs == 0
                if idle and time.monotonic() - self.published_at >= self.heartbeat_interval:
                    # blocked on its input queue: the same load again. Not the requests taken in
                    # since, which the next step publishes with the queue they join.
                    self._publish()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.heartbeat_interval)
        with self.lock:
            self.writer.close()
        self.board.close()


def waiting_tokens(scheduler: Any) -> int:
    """Tokens still to prefill of the requests waiting for admission (vLLM's two waiting queues)."""
    total = 0
    for queue in (scheduler.waiting, getattr(scheduler, "kv_holding_waiting", ())):
        for request in queue:
            total += max(0, request.num_tokens - request.num_computed_tokens)
    return total

