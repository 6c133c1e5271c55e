"""The load generator of ``dpboard demo``: Poisson arrivals with periodic bursts and a mix of
short and long prompts, sent as tokenized msgpack requests to the controller's PULL socket."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from dpboard.errors import InvalidInputError


@dataclass(frozen=True)
class LoadShape:
    rate: float  # requests per second between bursts
    burst_every: float = 6.0  # seconds from one burst to the next
    burst_seconds: float = 1.0
    burst_factor: float = 4.0  # arrival rate during a burst, as a multiple of ``rate``
    long_share: float = 0.2  # share of long prompts
    short_prompt: tuple[int, int] = (32, 512)
    long_prompt: tuple[int, int] = (2048, 8192)
    output: tuple[int, int] = (16, 192)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise InvalidInputError(f"--rate must be > 0 requests per second, got {self.rate}")
        if not 0 <= self.long_share <= 1:
            raise InvalidInputError(f"--long-share must be in [0, 1], got {self.long_share}")
        if self.burst_factor < 1 or self.burst_seconds < 0 or self.burst_every <= 0:
            raise InvalidInputError("bursts need --burst-factor >= 1, --burst-seconds >= 0 and --burst-every > 0")

    def rate_at(self, t: float) -> float:
        in_burst = self.burst_seconds > 0 and (t % self.burst_every) < self.burst_seconds
        return self.rate * (self.burst_factor if in_burst else 1.0)


class LoadGenerator(threading.Thread):
    """Sends requests until ``stop()``; ``sent`` counts them. Runs in the demo's own process."""

    def __init__(self, endpoint: str, shape: LoadShape, *, seed: int = 0, context: Any = None,
                 bootstrap_rooms: bool = False) -> None:
        super().__init__(name="dpboard-demo-load", daemon=True)
        self.endpoint = endpoint
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.sent = 0
        # follow_bootstrap_room routes by the request's room (a PD pair's), and refuses a request without one
        self.bootstrap_rooms = bootstrap_rooms
        self._stop_event = threading.Event()
        self._ctx = context or zmq.Context.instance()

    def stop(self) -> None:
        self._stop_event.set()

    def request(self, rid: int) -> dict[str, Any]:
        s, rng = self.shape, self.rng
        lo, hi = s.long_prompt if rng.random() < s.long_share else s.short_prompt
        return {
            "rid": f"demo-{rid}",
            "num_tokens": int(rng.integers(lo, hi + 1)),
            "routed_dp_rank": None,
            "bootstrap_room": int(rng.integers(0, 2**62)) if self.bootstrap_rooms else None,
            "output_len": int(rng.integers(s.output[0], s.output[1] + 1)),
            "sent_ns": time.time_ns(),
        }

    def run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self.endpoint)
        start = time.monotonic()
        next_at = 0.0
        try:
            while not self._stop_event.is_set():
                now = time.monotonic() - start
                while next_at <= now:
                    try:
                        sock.send(msgpack.packb(self.request(self.sent)), zmq.NOBLOCK)
                        self.sent += 1
                    except zmq.Again:
                        pass  # the controller is not keeping up: drop, as an overloaded frontend would
                    next_at += self.rng.exponential(1.0 / self.shape.rate_at(next_at))
                self._stop_event.wait(min(0.05, max(0.0, next_at - now)))
        finally:
            sock.close(0)
