"""The model of one DP rank in ``dpboard sim``: a scheduler loop over a KV cache.

Each rank runs steps back to back, like SGLang's scheduler loop, and picks up newly received
requests only between steps:

- Prefill has priority. When requests wait and a batch slot is free, a prefill step admits them in
  arrival order (no skipping ahead) while the running batch stays under ``max_running``, the KV
  cache has room for the prompt, and the step's prompt tokens stay under ``max_prefill_tokens``
  (one request is always admitted, however long: prefill is not chunked in this model). It takes
  ``prefill_base_s + prefill_s_per_token * tokens`` and ends with each admitted request's first
  token: time to first token is the end of that step minus the request's arrival.
- Otherwise a decode step gives every running request one token. It takes
  ``decode_base_s + decode_s_per_token * batch_tokens``, where batch_tokens is the KV the batch
  holds, so decode slows down as sequences grow.
- A decode step that would overflow the KV cache first retracts the most recently admitted
  requests back to the head of the waiting queue (their KV is freed; they are prefilled again
  later with what they had generated), as SGLang does.

A running request's finish is kept as the decode-step count at which it ends, so a decode step
costs O(1) plus O(log n) per request that finishes, not O(batch).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from dpboard.errors import InvalidInputError
from dpboard.snapshot import LoadSnapshot

# What a rank is doing.
IDLE = 0
PREFILL = 1
DECODE = 2


@dataclass(frozen=True)
class RankConfig:
    """One rank's capacity and speed. The defaults are in the range of an 8B model on one H100-class GPU."""

    kv_capacity: int = 160_000  # tokens of KV cache
    max_running: int = 128  # requests in the running batch
    max_prefill_tokens: int = 16384  # prompt tokens admitted per prefill step (at least one request)
    prefill_base_s: float = 0.004
    prefill_s_per_token: float = 40e-6  # 25k prompt tokens per second
    decode_base_s: float = 0.010
    decode_s_per_token: float = 60e-9  # +6 ms per step per 100k tokens in the batch

    def validate(self) -> RankConfig:
        if self.kv_capacity < 1 or self.max_running < 1 or self.max_prefill_tokens < 1:
            raise InvalidInputError("rank kv_capacity, max_running and max_prefill_tokens must be >= 1")
        for name in ("prefill_base_s", "prefill_s_per_token", "decode_base_s", "decode_s_per_token"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"rank {name} must be >= 0 seconds")
        if self.prefill_base_s + self.decode_base_s <= 0:
            raise InvalidInputError(
                "rank prefill_base_s and decode_base_s cannot both be 0 (steps would take no time)"
            )
        return self


class SimRequest:
    """One request of the trace, as the dispatcher and a rank see it.

    ``routed_dp_rank``, ``bootstrap_room`` and ``num_tokens`` are what the real ``Dispatcher`` reads;
    the rest is the simulator's record of what happened to it.
    """

    __slots__ = (
        "rid",
        "arrival_s",
        "prompt_len",
        "output_len",
        "is_burst",
        "routed_dp_rank",
        "bootstrap_room",
        "num_tokens",
        "rank",
        "received_s",
        "admitted_s",
        "first_token_s",
        "finished_s",
        "generated",
        "finish_step",
        "epoch",
        "retractions",
    )

    def __init__(self, rid: int, arrival_s: float, prompt_len: int, output_len: int, is_burst: bool = False):
        self.rid = rid
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.is_burst = is_burst
        self.routed_dp_rank: int | None = None
        self.bootstrap_room: int | None = None
        self.num_tokens = prompt_len  # the dispatcher's token estimate: the prompt length
        self.rank = -1
        self.received_s = -1.0
        self.admitted_s = -1.0  # first admission into a prefill batch
        self.first_token_s = -1.0
        self.finished_s = -1.0
        self.generated = 0
        self.finish_step = 0
        self.epoch = 0  # bumped on retraction, to drop its stale entry in the finish heap
        self.retractions = 0

    @property
    def seqlen(self) -> int:
        return self.prompt_len + self.generated

    def __repr__(self) -> str:
        return f"SimRequest(rid={self.rid}, prompt={self.prompt_len}, output={self.output_len}, rank={self.rank})"


class RankModel:
    """One DP rank: waiting queue, running batch, KV cache, and the step it is in."""

    def __init__(self, rank: int, config: RankConfig):
        self.rank = rank
        self.config = config.validate()
        self.waiting: deque[SimRequest] = deque()
        self.waiting_tokens = 0  # sum of seqlens in the waiting queue (they hold no KV)
        self.running: dict[int, SimRequest] = {}  # rid -> request, in admission order
        self._finish_heap: list[tuple[int, int, int]] = []  # (finish_step, rid, epoch)
        self.used_tokens = 0  # KV held by the running batch and the prefill in progress
        self.decode_steps = 0
        self.state = IDLE
        self._prefill_batch: list[SimRequest] = []
        self.received = 0  # cumulative requests received from the controller
        self.finished: list[SimRequest] = []
        self.retracted = 0
        self.busy_s = 0.0  # time spent in steps (for utilisation)

    # -- what the rank is ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self._prefill_batch)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def total_tokens(self) -> int:
        """SGLang's num_total_tokens: KV in use plus the seqlens of requests still waiting for KV."""
        return self.used_tokens + self.waiting_tokens

    @property
    def idle(self) -> bool:
        return self.state == IDLE

    def snapshot(self, now_s: float, publish_seq: int) -> LoadSnapshot:
        """The load this rank would publish now; the clock fields come from the simulated clock."""
        now_ns = int(round(now_s * 1e9))
        total = self.total_tokens
        return LoadSnapshot(
            dp_rank=self.rank,
            num_running_reqs=self.num_running,
            num_waiting_reqs=self.num_waiting,
            num_used_tokens=self.used_tokens,
            num_total_tokens=total,
            num_active_tokens=total,
            max_total_num_tokens=self.config.kv_capacity,
            num_received_reqs=self.received,
            timestamp_ns=now_ns,
            monotonic_ns=now_ns,
            publish_seq=publish_seq,
            writer_pid=0,
            node_id=0,
        )

    # -- events --------------------------------------------------------------------------------

    def receive(self, req: SimRequest, now_s: float) -> None:
        req.rank = self.rank
        req.received_s = now_s
        self.received += 1
        self.waiting.append(req)
        self.waiting_tokens += req.seqlen

    def begin_step(self, now_s: float) -> float | None:
        """Choose the next step and return its duration, or None when there is nothing to do."""
        cfg = self.config
        if self.waiting and len(self.running) < cfg.max_running:
            batch = self._form_prefill_batch()
            if batch:
                tokens = 0
                for req in batch:
                    tokens += req.seqlen
                    if req.admitted_s < 0:
                        req.admitted_s = now_s
                self.used_tokens += tokens
                self.waiting_tokens -= tokens
                self._prefill_batch = batch
                self.state = PREFILL
                return cfg.prefill_base_s + cfg.prefill_s_per_token * tokens
        if self.running:
            # Each running request needs one more KV token this step: make room by retraction.
            while self.used_tokens + len(self.running) > cfg.kv_capacity and len(self.running) > 1:
                self._retract_newest()
            self.state = DECODE
            return cfg.decode_base_s + cfg.decode_s_per_token * self.used_tokens
        self.state = IDLE
        return None

    def end_step(self, now_s: float) -> int:
        """Apply the step that just ended; returns how many requests finished in it."""
        done_before = len(self.finished)
        if self.state == PREFILL:
            batch, self._prefill_batch = self._prefill_batch, []
            for req in batch:
                req.generated += 1
                self.used_tokens += 1
                if req.first_token_s < 0:
                    req.first_token_s = now_s
                if req.generated >= req.output_len:
                    self._finish(req, now_s)
                else:
                    req.finish_step = self.decode_steps + (req.output_len - req.generated)
                    self.running[req.rid] = req
                    heapq.heappush(self._finish_heap, (req.finish_step, req.rid, req.epoch))
        elif self.state == DECODE:
            self.decode_steps += 1
            self.used_tokens += len(self.running)
            heap = self._finish_heap
            while heap and heap[0][0] <= self.decode_steps:
                _, rid, epoch = heapq.heappop(heap)
                req = self.running.get(rid)
                if req is None or req.epoch != epoch:
                    continue  # retracted since this entry was pushed
                del self.running[rid]
                req.generated = req.output_len
                self._finish(req, now_s)
        self.state = IDLE
        return len(self.finished) - done_before

    # -- internals -----------------------------------------------------------------------------

    def _form_prefill_batch(self) -> list[SimRequest]:
        cfg = self.config
        batch: list[SimRequest] = []
        tokens = 0
        free_slots = cfg.max_running - len(self.running)
        # Room for the prompts plus one decode token for everything already running.
        kv_room = cfg.kv_capacity - self.used_tokens - len(self.running)
        for req in self.waiting:
            if len(batch) >= free_slots:
                break
            if tokens + len(batch) + req.seqlen + 1 > kv_room:
                break
            if batch and tokens + req.seqlen > cfg.max_prefill_tokens:
                break
            batch.append(req)
            tokens += req.seqlen
        for _ in batch:
            self.waiting.popleft()
        return batch

    def _retract_newest(self) -> None:
        rid = next(reversed(self.running))
        req = self.running.pop(rid)
        req.generated = req.output_len - (req.finish_step - self.decode_steps)
        self.used_tokens -= req.seqlen
        req.epoch += 1
        req.retractions += 1
        self.retracted += 1
        self.waiting.appendleft(req)
        self.waiting_tokens += req.seqlen

    def _finish(self, req: SimRequest, now_s: float) -> None:
        req.finished_s = now_s
        self.used_tokens -= req.seqlen
        self.finished.append(req)
