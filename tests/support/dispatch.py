"""Requests, a list reader and a clock for the dispatcher tests: plain inputs, as the Dispatcher takes."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpboard import LoadSnapshot
from dpboard.controller import Dispatcher, LoadBalanceMethod


@dataclass
class Req:
    input_ids: list[int] = field(default_factory=lambda: [0] * 10)
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


@dataclass
class TokReq:
    num_tokens: int
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


class ListReader:
    """A reader in the read_all() form; tests set ``snaps`` (index = rank)."""

    def __init__(self, n: int):
        self.snaps: list[LoadSnapshot | None] = [None] * n
        self.reads = 0

    def read_all(self) -> list[LoadSnapshot | None]:
        self.reads += 1
        return list(self.snaps)

    def set(self, rank: int, running: int = 0, waiting: int = 0, tokens: int = 0, seq: int | None = None,
            received: int = 0, used: int = 0) -> None:
        old = self.snaps[rank]
        seq = (old.publish_seq + 1 if old else 1) if seq is None else seq
        self.snaps[rank] = LoadSnapshot(dp_rank=rank, num_running_reqs=running, num_waiting_reqs=waiting,
                                        num_used_tokens=used, num_total_tokens=tokens,
                                        num_received_reqs=received, publish_seq=seq, timestamp_ns=seq)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(method, n=4, reader=None, **kw):
    clock = kw.pop("clock", FakeClock())
    if reader is None and LoadBalanceMethod(method).is_load_aware:
        reader = ListReader(n)
    return Dispatcher(method, n, reader=reader, clock=clock, **kw), reader, clock
