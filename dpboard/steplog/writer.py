"""``StepLog``: one scheduler's step log, filled on the scheduler's thread, written by a thread of its own.

The scheduler's thread (the hot path) only packs a step's numbers into a preallocated row: no file
I/O, no lock, no buffer made per step. A step is either recorded whole (``record``) or in two halves
where the engine hands its numbers at launch and its end later (``begin`` then ``end``: SGLang's
overlap scheduler and vLLM's batch queue process a step's result after the next step is launched);
a half-done step waits in one of ``PENDING`` rows, looked up by its step number.

Finished rows go into a ring of ``ring_rows`` rows, one producer (the scheduler) and one consumer
(the writer thread): the producer writes only slots at or past ``head`` and advances ``head``; the
consumer copies ``[tail, head)`` to the file every ``flush_interval`` and advances ``tail``. Neither
waits for the other. When the ring is full (the writer fell ``ring_rows`` steps behind), the step is
dropped and counted (``dropped_ring``); never does the scheduler wait.

The file is capped at ``max_bytes`` (prelude and header included): rows past the cap are counted
(``dropped_cap``) and not written; a write that fails (a full disk) stops the writing, counted as
``dropped_io`` and logged once. The counts are in the file's prelude, rewritten at every flush
(format.py), so a log whose process was killed still says what it lost up to its last flush.

An exception inside an engine's hook is the recorder's, never the engine's: ``fault`` counts it (in
the prelude too) and logs the 1st, 10th, 100th... one, the first with its traceback; after
``MAX_FAULTS`` the engine's adapter stops recording (``fault`` returns True).
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import math
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

from dpboard.errors import AccessDeniedError, UnavailableError
from dpboard.steplog import format as fmt

log = logging.getLogger("dpboard.steplog")

RING_ROWS = 8192  # 512 KiB: 8 s of 1 ms steps between two flushes of a writer that fell behind
PENDING = 8  # steps begun and not yet ended (the overlap scheduler has 2 at most)
FLUSH_INTERVAL = 0.1  # seconds
MAX_FAULTS = 1000  # after as many faults the adapter stops recording
_OPEN_ATTEMPTS = 100

_ROW = fmt.RECORD_SIZE
_FLAGS_AT = fmt.record_offsets()["flags"]
_DURATION_AT = fmt.record_offsets()["duration_ns"]


def logged_now(count: int) -> bool:
    """Whether the ``count``-th time of a repeated event is logged: the 1st, 10th, 100th..."""
    return count > 0 and math.log10(count).is_integer()


class StepLog:
    """One scheduler's step log (see the module's docstring). ``header`` holds the engine's part of
    the header line (``settings`` among it); the log adds the format, the clock, the pid and the cap."""

    def __init__(self, directory: str | os.PathLike[str], *, engine: str, rank: int, header: dict[str, Any],
                 max_bytes: int, ring_rows: int = RING_ROWS, flush_interval: float = FLUSH_INTERVAL,
                 at_exit: bool = True) -> None:
        self.engine = engine
        self.rank = int(rank)
        self.flush_interval = flush_interval
        self.rows = int(ring_rows)
        self.pid = os.getpid()
        self.fd, self.path = _create(Path(directory), engine, self.pid, self.rank)
        started_mono, started_unix = time.monotonic_ns(), time.time_ns()
        doc = {"format": fmt.FORMAT_NAME, "version": fmt.VERSION, "engine": engine, "rank": self.rank,
               "pid": self.pid, "clock": "monotonic_ns", "started_monotonic_ns": started_mono,
               "started_unix_ns": started_unix, "max_bytes": int(max_bytes), "ring_rows": self.rows,
               "flush_interval_s": flush_interval, **header}
        header_line = fmt.pad_header(json.dumps(doc, sort_keys=False, default=str))
        self.header = doc
        self.header_len = len(header_line)
        self.data_offset = fmt.PRELUDE.size + self.header_len
        self.capacity_rows = max(0, (int(max_bytes) - self.data_offset) // _ROW)
        # counts: the producer's (dropped_ring, unmatched, faults) and the writer's (written, dropped_*)
        self.written = self.dropped_cap = self.dropped_ring = self.dropped_io = 0
        self.faults = self.unmatched = 0
        self.closed = False
        self._io_failed = False
        self._ring = bytearray(self.rows * _ROW)
        self._ring_view = memoryview(self._ring)
        self._pending = bytearray(PENDING * _ROW)
        self._pending_view = memoryview(self._pending)
        self._pending_step = [-1] * PENDING
        self._pending_t0 = [0] * PENDING
        self._last_begun = -1
        self.head = 0  # rows the scheduler has finished (only it writes this)
        self.tail = 0  # rows the writer has taken (only it writes this)
        self._flush_lock = threading.Lock()  # the writer thread and close(): never the scheduler
        self._stop = threading.Event()
        try:
            _pwrite_all(self.fd, self._prelude(0) + header_line, 0)
        except BaseException:
            os.close(self.fd)
            raise
        self._thread = threading.Thread(target=self._run, name=f"dpboard-steplog-rank{self.rank}", daemon=True)
        self._thread.start()
        if at_exit:
            atexit.register(self.close)

    # -- the hot path (the scheduler's thread) ---------------------------------------------------------

    def record(self, t_start_ns: int, duration_ns: int, step: int, prefix_tokens: int, decode_ctx_tokens: int,
               prefill_tokens: int, prefill_reqs: int, decode_reqs: int, decode_tokens: int, batch_size: int,
               mode: int, flags: int = 0, raw_mode: int = 0, launch_ns: int = 0) -> None:
        """A whole step: one row into the ring (or counted in ``dropped_ring`` when it is full).
        ``launch_ns``: from its start until the batch was launched (0: not recorded; format.py)."""
        head = self.head
        if head - self.tail >= self.rows:
            self.dropped_ring += 1
            return
        fmt.RECORD.pack_into(self._ring, (head % self.rows) * _ROW, t_start_ns, duration_ns, launch_ns, step,
                             prefix_tokens, decode_ctx_tokens, prefill_tokens, prefill_reqs, decode_reqs,
                             decode_tokens, batch_size, mode, flags, raw_mode)
        self.head = head + 1

    def begin(self, step: int, t_start_ns: int, prefix_tokens: int, decode_ctx_tokens: int, prefill_tokens: int,
              prefill_reqs: int, decode_reqs: int, decode_tokens: int, batch_size: int, mode: int, flags: int = 0,
              raw_mode: int = 0, launch_ns: int = 0) -> None:
        """The first half of step ``step`` (its numbers, as launched, and ``launch_ns``: from its start
        until the batch was launched, 0 where not recorded); ``end(step, ...)`` finishes it."""
        p = step % PENDING
        if self._pending_step[p] >= 0:
            self.unmatched += 1  # a step begun PENDING steps ago never ended: its row is reused
        fmt.RECORD.pack_into(self._pending, p * _ROW, t_start_ns, -1, launch_ns, step, prefix_tokens,
                             decode_ctx_tokens, prefill_tokens, prefill_reqs, decode_reqs, decode_tokens, batch_size,
                             mode, flags, raw_mode)
        self._pending_step[p] = step
        self._pending_t0[p] = t_start_ns
        if step > self._last_begun:
            self._last_begun = step

    def end(self, step: int, t_end_ns: int) -> None:
        """The step's result is processed: its duration, and its row into the ring. A step that was
        never begun (or was overwritten) is counted in ``unmatched`` and written nowhere."""
        p = step % PENDING
        if self._pending_step[p] != step:
            self.unmatched += 1
            return
        self._pending_step[p] = -1
        at = p * _ROW
        _DURATION.pack_into(self._pending, at + _DURATION_AT, t_end_ns - self._pending_t0[p])
        if self._last_begun > step:
            self._pending[at + _FLAGS_AT] |= fmt.OVERLAPPED
        head = self.head
        if head - self.tail >= self.rows:
            self.dropped_ring += 1
            return
        to = (head % self.rows) * _ROW
        self._ring_view[to:to + _ROW] = self._pending_view[at:at + _ROW]
        self.head = head + 1

    # -- faults ----------------------------------------------------------------------------------------

    def fault(self, error: BaseException, where: str) -> bool:
        """An exception in ``where`` (an engine's hook): counted, logged at the 1st, 10th, 100th... time
        (the first with its traceback). True once there were ``MAX_FAULTS``: stop recording."""
        self.faults += 1
        if logged_now(self.faults):
            log.warning("dpboard: %s: %s in the step recorder (%s); the engine's step went on unrecorded "
                        "(step-log fault #%d, %s)", type(error).__name__, error, where, self.faults, self.path,
                        exc_info=error if self.faults == 1 else None)
        if self.faults >= MAX_FAULTS:
            log.warning("dpboard: %d faults in the step recorder: it stops; %s holds the steps so far",
                        self.faults, self.path)
            return True
        return False

    # -- the writer thread -----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {"written": self.written, "dropped_cap": self.dropped_cap, "dropped_ring": self.dropped_ring,
                "faults": self.faults, "unmatched": self.unmatched, "flush_unix_ns": time.time_ns(),
                "dropped_io": self.dropped_io}

    def _prelude(self, flags: int) -> bytes:
        return fmt.pack_prelude(self.header_len, flags, self.counters())

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush()
            except Exception:  # never the engine's: the log stops, the engine runs on
                log.exception("dpboard: the step log's writer failed; %s is left as it is", self.path)
                return

    def flush(self, flags: int = 0) -> None:
        """Write the rows the scheduler finished since the last flush (up to the cap), then the counts."""
        with self._flush_lock:
            head, tail = self.head, self.tail
            n = head - tail
            if n:
                take = 0 if self._io_failed else min(n, max(0, self.capacity_rows - self.written))
                done = 0
                try:
                    while done < take:
                        at = (tail + done) % self.rows
                        k = min(take - done, self.rows - at)
                        _pwrite_all(self.fd, self._ring_view[at * _ROW:(at + k) * _ROW],
                                    self.data_offset + (self.written + done) * _ROW)
                        done += k
                except OSError as e:
                    self._io_failed = True
                    log.warning("dpboard: the step log %s cannot be written (%s): it stops writing; the steps "
                                "after it are counted in its prelude", self.path, e)
                self.written += done
                if self._io_failed:
                    self.dropped_io += n - done
                else:
                    self.dropped_cap += n - done
                self.tail = head
            try:
                _pwrite_all(self.fd, self._prelude(flags), 0)
            except OSError:
                self._io_failed = True

    def close(self) -> None:
        """Stop the writer, write what is left and the final counts (flag CLOSED). Idempotent; never
        raises (the engine's shutdown calls it)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        try:
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            self.flush(fmt.CLOSED)
        except Exception:
            log.exception("dpboard: the step log %s was not closed cleanly", self.path)
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass
            try:
                atexit.unregister(self.close)
            except Exception:  # noqa: BLE001 - at interpreter exit: nothing to undo
                pass


_DURATION = struct.Struct("<q")


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        offset += n


def _create(directory: Path, engine: str, pid: int, rank: int) -> tuple[int, Path]:
    """A new file of this process in ``directory`` (O_EXCL, no link followed, mode 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for attempt in range(_OPEN_ATTEMPTS):
        path = directory / fmt.file_name(engine, pid, rank, attempt)
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue  # an earlier process of the same pid, or a name planted there: never reused
        except PermissionError as e:
            raise AccessDeniedError(f"cannot create the step log {path}: {e.strerror}; name a directory this "
                                    f"process can write in DPBOARD_STEP_LOG") from None
    raise UnavailableError(f"{_OPEN_ATTEMPTS} step logs named {fmt.file_name(engine, pid, rank)} and its "
                           f"variants exist in {directory}: remove old ones")
