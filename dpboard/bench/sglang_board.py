"""Baseline for the board benchmark: a board that works the way SGLang 0.5.23's shared-memory load
snapshots do, written from this description (not from its source):

- one file in /dev/shm, a 16 KiB slot per rank, each slot a little-endian u32 length followed by a
  msgpack-encoded dict of the snapshot's fields;
- the writer encodes, takes an exclusive ``fcntl.flock`` on the whole file, copies length and
  payload into its slot, and unlocks;
- a reader takes the shared lock across a whole ``read_all`` and decodes every slot.

It exists only to be measured beside dpboard in the same run (``dpboard bench board``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time

import msgpack

from dpboard.snapshot import FIELD_NAMES, LoadSnapshot

SLOT_BYTES = 16 * 1024
_LEN = struct.Struct("<I")


class FlockBoard:
    def __init__(self, path: str, n_slots: int, *, create: bool):
        self.path = path
        self.n_slots = n_slots
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, n_slots * SLOT_BYTES)
        self.mm = mmap.mmap(self.fd, n_slots * SLOT_BYTES)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class FlockWriter:
    def __init__(self, board: FlockBoard, rank: int):
        self.board = board
        self.rank = rank
        self.offset = rank * SLOT_BYTES
        self.publish_seq = 0
        self.pid = os.getpid()

    def publish(self, snap: LoadSnapshot) -> None:
        self.publish_seq += 1
        record = snap._asdict()
        record.update(timestamp_ns=time.time_ns(), monotonic_ns=time.monotonic_ns(),
                      publish_seq=self.publish_seq, writer_pid=self.pid)
        payload = msgpack.packb(record)
        fd, mm, off = self.board.fd, self.board.mm, self.offset
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            _LEN.pack_into(mm, off, len(payload))
            mm[off + 4 : off + 4 + len(payload)] = payload
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class FlockReader:
    def __init__(self, board: FlockBoard):
        self.board = board

    def read_all(self) -> list[LoadSnapshot | None]:
        fd, mm = self.board.fd, self.board.mm
        out: list[LoadSnapshot | None] = []
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            for rank in range(self.board.n_slots):
                off = rank * SLOT_BYTES
                (length,) = _LEN.unpack_from(mm, off)
                if length == 0:
                    out.append(None)
                    continue
                record = msgpack.unpackb(mm[off + 4 : off + 4 + length])
                out.append(LoadSnapshot(**{k: record[k] for k in FIELD_NAMES}))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return out
