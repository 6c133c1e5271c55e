"""``dpboard serve NAME``: a board over HTTP.

- ``GET /v1/loads`` — SGLang 0.5.23's loads document, key for key (``dpboard.views.loads_document``):
  ``{"timestamp", "version", "accelerator", "num_accelerators", "loads": [one object per live rank]}``
  plus dpboard's own keys; ``?dp_rank=N``, ``?include=core,memory,spec,lora,disagg,queues,all`` and
  ``?format=prometheus`` as SGLang reads them.
- ``GET /metrics`` — the Prometheus text format (prometheus-client), every rank and the board summary,
  under names that follow Prometheus's rules, plus the series SGLang's model gateway reads when it
  falls back from ``/v1/loads`` (``dpboard.views.metrics``).
- ``GET /healthz`` — 200 while the board is attached, 503 while it is gone: the slots' status
  counts from a read of their status only, beside (never behind) the full reads of the other paths.
- ``GET /v1/board`` — what ``dpboard top --json`` shows of one read, every slot (stale ones with
  their last snapshot) and the board's header (``board_document``); no rates: a reader derives
  them from each row's ``publish_seq``, ``num_received_reqs`` and ``monotonic_ns`` between reads.
- ``GET /v1/doctor`` — ``dpboard doctor``'s findings over the last samples this path took
  (``{"healthy", "window_s", "findings": [{"severity", "title", "evidence", "cause", "fix"}]}``).
- ``GET /`` — the live page (``live.html`` beside this module): what ``dpboard top`` shows, in a
  browser, its script reading ``/v1/board`` about once a second. One file, no external asset.

Bad query parameters get a 400 whose JSON body says what was wrong and what is accepted. The
server is a stdlib ``ThreadingHTTPServer``; a lock serialises reads of the board (the reader's
output array is shared). No Numba import: it starts as fast as ``dpboard dump``.

Each open connection holds a thread and a descriptor, so what a client may hold is bounded (a slow
client, "slowloris", once took every descriptor): a request's first byte must come within
``idle_timeout`` and its headers must be whole ``header_timeout`` after it; at most
``max_connections`` are open (``dpboard.guard.ConnectionGuard``: a connection that never completed a
request goes first, the oldest first, then the one idle longest); and an ``accept`` that fails for
want of descriptors backs off instead of spinning. A request body is read and dropped (at most
``MAX_BODY`` bytes, within the header deadline) or refused, so that it is never taken for a second
request: two ``Content-Length`` headers, one that is not a number, or a ``Transfer-Encoding`` get a
400, a longer body a 413, and the connection is closed.
"""

from __future__ import annotations

import argparse
import errno
import functools
import io
import json
import math
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import dpboard
from dpboard.board import DEFAULT_STALE_AFTER
from dpboard.board.stale import stale_after
from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.guard import ConnectionGuard, Proof, fd_budget
from dpboard.options import count, seconds
from dpboard.snapshot import SlotStatus
from dpboard.views.doctor import MAX_WATCH_SLOTS, DoctorWatch, Finding
from dpboard.views.loads_document import (
    PROMETHEUS_CONTENT_TYPE,
    IncludeError,
    loads_document,
    parse_include,
    prometheus_loads,
)
from dpboard.views.metrics import prometheus_text
from dpboard.views.watch import BoardWatch, Frame

_LOADS_PARAMS = "dp_rank=N, include=core,memory,spec,lora,disagg,queues,all and format=json|prometheus"
_INT = re.compile(r"[+-]?[0-9]+")


class BadRequest(InvalidInputError):
    """A query the server refuses with 400; the message names the parameter and the fix."""


IDLE_TIMEOUT = 30.0  # seconds a connection may wait for a request's first byte (and a write may block)
HEADER_TIMEOUT = 10.0  # seconds from a request's first byte to the end of its headers
MAX_CONNECTIONS = 256  # open connections (each holds a thread); fewer where the open-file limit is low
FD_RESERVE = 32  # descriptors kept out of the connection cap: listening socket, board, logs, imports
ACCEPT_BACKOFF = (0.01, 0.5)  # seconds: the first and the longest pause after accept() ran out of descriptors
ACCEPT_HOLD = 0.01  # seconds between two sheds for want of descriptors
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
MAX_BODY = 64 * 1024  # bytes of a request body read (and dropped): no route takes one
MAX_RANK_DIGITS = 19  # a dp_rank beyond int64 names no rank
DOCTOR_WINDOW = 10.0  # seconds of samples behind /v1/doctor
DOCTOR_EVERY = 0.5  # seconds between two of its samples, at most


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (a malformed or hostile detail float) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_body(doc: Any) -> bytes:
    """Standard JSON (RFC 8259 has no NaN or Infinity): non-finite floats are sent as null."""
    try:
        text = json.dumps(doc, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(doc), allow_nan=False)
    return (text + "\n").encode()


def connections_allowed(wanted: int = MAX_CONNECTIONS) -> int:
    """``wanted``, or what the open-file limit leaves after FD_RESERVE where that is less (at least
    1): connections must never take the descriptors that reading the board needs."""
    return fd_budget(wanted, FD_RESERVE)


class _HealthReader:
    """The slots' status for /healthz, read beside the full reads (its own reader and array, its own
    lock): one status read of 65,536 slots takes milliseconds, one full sample seconds."""

    def __init__(self, stale_after: float) -> None:
        self.stale_after = stale_after
        self._lock = threading.Lock()
        self._board: Any = None
        self._reader: Any = None

    def counts(self, board: Any) -> dict[str, int]:
        with self._lock:
            if board is not self._board:
                self._reader = board.reader(stale_after=self.stale_after)  # it keeps its own mapping
                self._board = board
            status = self._reader.read_array()["status"]
            found = np.bincount(status, minlength=len(SlotStatus))
            return {s.label: int(found[int(s)]) for s in SlotStatus}


class LoadsServer(ThreadingHTTPServer):
    """The HTTP exporter of one board. ``url`` is where it listens; ``serve_forever`` serves.

    ``idle_timeout``: seconds a connection may wait for a request's first byte; ``header_timeout``:
    seconds from that byte until the headers are whole; ``max_connections``: open connections at
    most (default MAX_CONNECTIONS); to make room for a new one, ``guard`` (a ``ConnectionGuard``)
    closes one that sent nothing, then one still sending its headers, then the one idle longest,
    and refuses the new one when every open one is answering a request. The cap never exceeds what
    the open-file limit leaves after FD_RESERVE (``connections_allowed``), and comes down when
    ``accept`` finds no descriptor (the limit was lowered, or descriptors went elsewhere)."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits in the kernel's queue, not refused

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 8080, *,
                 stale_after: float = DEFAULT_STALE_AFTER, wait: bool = False,
                 accelerator: str | None = None, num_accelerators: int = 1,
                 trust_uids: Iterable[int] = (), idle_timeout: float = IDLE_TIMEOUT,
                 header_timeout: float = HEADER_TIMEOUT, max_connections: int | None = None) -> None:
        if not 0 < idle_timeout <= 3600:
            raise InvalidInputError(f"idle_timeout must be in (0, 3600] seconds, got {idle_timeout!r}")
        if not 0 < header_timeout <= 3600:
            raise InvalidInputError(f"--header-timeout must be in (0, 3600] seconds, got {header_timeout!r}")
        if max_connections is None:
            max_connections = MAX_CONNECTIONS
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or not (
                1 <= max_connections <= 65536):
            raise InvalidInputError(f"--max-connections must be in 1..65536, got {max_connections!r}")
        self.idle_timeout = idle_timeout
        self.header_timeout = header_timeout
        self.guard = ConnectionGuard(connections_allowed(max_connections), keep=1.0, hold=ACCEPT_HOLD,
                                     backoff=ACCEPT_BACKOFF, shed_proved="idlest")
        self._connections: dict[int, socket.socket] = {}  # id() of the socket -> the socket
        self._connections_lock = threading.Lock()
        if not 0 <= port <= 65535:
            raise InvalidInputError(f"--port must be in 0..65535 (0 picks a free port), got {port}")
        if num_accelerators < 0:
            raise InvalidInputError(f"--num-accelerators must be >= 0, got {num_accelerators}")
        self.accelerator = accelerator
        self.num_accelerators = num_accelerators
        self.watch = BoardWatch(name, stale_after=stale_after, wait=wait, trust_uids=trust_uids)
        self._health = _HealthReader(stale_after)
        self.doctor = DoctorWatch(window=DOCTOR_WINDOW, every=DOCTOR_EVERY, stale_after=stale_after,
                                  trust_uids=tuple(trust_uids))
        self._lock = threading.Lock()
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            self.watch.close()
            raise UnavailableError(_listen_failure(host, port, e)) from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def sample(self) -> Frame:
        with self._lock:
            return self.watch.sample()

    @property
    def max_connections(self) -> int:
        return self.guard.cap

    def health(self) -> tuple[dict[str, Any] | None, str | None]:
        """/healthz's document, or ``(None, why)`` while the board is gone. Never behind the lock that
        full reads hold: the board is followed only when that lock is free, else the watch's board
        is checked (``is_current``) and its slots' status read apart."""
        if self._lock.acquire(blocking=False):
            try:
                self.watch.follow()
            finally:
                self._lock.release()
        board = self.watch.board
        if board is None:
            return None, self.watch.gone or "the board is gone"
        if not board.is_current():
            return None, (f"board {self.watch.name!r} is gone (its segment was removed or replaced); waiting for "
                          f"it to come back")
        try:
            counts = self._health.counts(board)
        except Exception as e:  # noqa: BLE001 - a board closed under the read: gone for now, not a 500
            return None, f"board {self.watch.name!r} cannot be read now: {e}"
        return {"status": "ok", "board": board.name, "n_slots": board.n_slots, "slots": counts,
                "version": dpboard.__version__}, None

    def frame(self) -> Frame:
        """One read of the board that moves no viewer's rates or history (``BoardWatch.frame``)."""
        with self._lock:
            return self.watch.frame()

    def loads_reply(self, render: Any) -> tuple[Any, str | None]:
        """``render(records)`` of one detailed read of every slot, under the lock (the read's array
        is shared); ``(None, why)`` while the board is gone."""
        with self._lock:
            records = self.watch.read_detailed()
            if records is None:
                return None, self.watch.gone
            return render(records), None

    def doctor_document(self) -> tuple[dict[str, Any] | None, str | None]:
        """The doctor's document now (its window rolls on), or ``(None, why)`` while the board is gone."""
        with self._lock:
            if self.watch.read_detailed() is None:  # follows a board that was replaced
                self.doctor.observe_watch(self.watch)
                return None, self.watch.gone
            board = self.watch.board
            if not self.doctor.covers(board):
                return {"healthy": True, "window_s": 0.0, "findings": [Finding(
                    "info", "too many slots to diagnose here", f"board {self.watch.name!r} has {board.n_slots} slots",
                    f"the live doctor covers boards of at most {MAX_WATCH_SLOTS} slots",
                    f"run `dpboard doctor {self.watch.name}`", "not_covered").as_dict()]}, None
            self.doctor.observe_watch(self.watch)
            return self.doctor.document(), None

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            self.watch.close()

    # -- the bounds on connections --------------------------------------------------------------

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return self.socket.accept()
        except OSError as e:
            if e.errno in _OUT_OF_DESCRIPTORS:
                # The listening socket stays readable: retrying at once would spin. The guard lowers
                # the cap to what fits and names connections to close, or a pause, longer each time.
                # in_use=0: the limit itself less the reserve, what the connections may take of it
                decision = self.guard.out_of_fds(fits=fd_budget(self.guard.full_cap, FD_RESERVE, in_use=0))
                self._close(decision.victims)
                time.sleep(max(decision.pause, decision.wait, ACCEPT_HOLD))
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections[id(request)] = request
        victims, refused = self.guard.opened(id(request), protect=True)
        self._close(victims)
        if refused:  # every other open connection is answering a request: this one waits its turn
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def _close(self, keys: list) -> None:
        """Shut the named connections down (their threads then end them)."""
        for key in keys:
            with self._connections_lock:
                sock = self._connections.get(key)
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv with end-of-file
            except OSError:
                pass  # already gone

    def connection_state(self, sock: socket.socket, *, busy: bool, proof: Proof | None = None) -> None:
        """The handler of ``sock`` starts answering a request (busy) or waiting for the next one;
        ``proof``: what its client showed (a byte of a request, a whole request)."""
        if proof is not None:
            self.guard.prove(id(sock), proof)
        self.guard.set_busy(id(sock), busy)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.pop(id(request), None)
        self.guard.closed(id(request))
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that went away, or a connection the cap closed: nothing to report
        super().handle_error(request, client_address)


def _listen_failure(host: str, port: int, error: OSError) -> str:
    """Why ``(host, port)`` cannot be listened on, blaming the option that is wrong."""
    if isinstance(error, socket.gaierror):
        return (f"--host {host!r} is neither an IP address nor a name this machine resolves ({error.strerror}): "
                f"give an address of this machine, e.g. 127.0.0.1 or 0.0.0.0")
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host!r} is not an address of this machine: give one of its own, or 0.0.0.0 for all"
    return f"cannot listen on {host}:{port}: {error.strerror}; pick another --port (0 picks a free one)"


class _HeaderDeadlineReader(io.RawIOBase):
    """A connection's reads: the first byte of a request within ``idle_timeout``, the rest of its
    headers before the handler's deadline (``header_timeout`` after that byte). The socket's own
    timeout bounds each ``recv`` only, which a client sending a byte at a time never meets."""

    def __init__(self, sock: socket.socket, handler: _Handler) -> None:
        self.sock = sock
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        handler = self.handler
        deadline = handler.header_deadline
        if deadline is None:
            self.sock.settimeout(handler.server.idle_timeout)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request headers not whole within {handler.server.header_timeout:g} s")
            self.sock.settimeout(min(left, handler.server.idle_timeout))
        n = self.sock.recv_into(buffer)
        if n and deadline is None and handler.reading_headers:
            handler.header_deadline = time.monotonic() + handler.server.header_timeout
            handler.server.connection_state(self.sock, busy=False, proof=Proof.SPOKE)
        return n


class _Handler(BaseHTTPRequestHandler):
    server: LoadsServer
    protocol_version = "HTTP/1.1"

    header_deadline: float | None = None  # when the current request's headers must be whole
    reading_headers = False

    def setup(self) -> None:
        # Each open connection holds a thread: one that waits too long for a request, or sends
        # its headers too slowly, is closed (the reader below); so is one whose write blocks.
        self.timeout = self.server.idle_timeout
        super().setup()
        self.rfile = io.BufferedReader(_HeaderDeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        self.server.connection_state(self.connection, busy=False)
        self.header_deadline, self.reading_headers = None, True
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers
        self.header_deadline, self.reading_headers = None, False
        self.connection.settimeout(self.server.idle_timeout)  # for the response's writes
        self.server.connection_state(self.connection, busy=True, proof=Proof.VALID if ok else None)
        return ok and self._take_body()

    def _take_body(self) -> bool:
        """Read and drop the request's body, or refuse it and close: a body left unread would be
        parsed as the next request (two responses to one, a proxy's queue out of step)."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get_all("Transfer-Encoding"):
            return self._refuse(400, "Transfer-Encoding is not taken: this server reads no request body; send the "
                                     "request without one")
        if len(lengths) > 1:
            return self._refuse(400, f"Content-Length is given {len(lengths)} times: give it once")
        if not lengths:
            return True
        text = lengths[0].strip()
        if not text.isdigit() or not text.isascii() or len(text) > 18:
            return self._refuse(400, f"Content-Length {text[:40]!r} is not a length in bytes")
        size = int(text)
        if size > MAX_BODY:
            return self._refuse(413, f"a request body of {size} bytes: this server reads none (at most {MAX_BODY} "
                                     f"bytes are dropped); send the request without one")
        self.header_deadline = time.monotonic() + self.server.header_timeout  # the body, like the headers
        try:
            got = len(self.rfile.read(size)) if size else 0
        finally:
            self.header_deadline = None
            self.connection.settimeout(self.server.idle_timeout)
        if got < size:
            self.close_connection = True  # the client went away, or the deadline passed
            return False
        return True

    def _refuse(self, status: int, message: str) -> bool:
        """Answer ``status`` and close the connection: what follows on it cannot be told apart."""
        self.close_connection = True
        body = json_body({"error": message, "status": status})
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return False

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass  # a scrape every few seconds would flood the terminal

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, doc: Any) -> None:
        self._send(status, json_body(doc), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._send_json(status, {"error": message, "status": status})

    def do_HEAD(self) -> None:  # noqa: N802 - the stdlib's name
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        parts = urlsplit(self.path)
        try:
            query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        except ValueError:
            self._error(400, f"malformed query string {parts.query!r}: use name=value pairs joined by '&'")
            return
        route = {"/v1/loads": self._loads, "/metrics": self._metrics, "/healthz": self._healthz,
                 "/v1/board": self._board, "/v1/doctor": self._doctor,
                 "/": self._page}.get(parts.path.rstrip("/") or "/")
        if route is None:
            self._error(404, f"no such path {parts.path!r}: this server has / (the live page), /v1/loads, "
                             f"/v1/board, /v1/doctor, /metrics and /healthz")
            return
        try:
            route(query)
        except BadRequest as e:
            self._error(400, str(e))

    # -- routes -------------------------------------------------------------------------------

    def _loads(self, query: dict[str, list[str]]) -> None:
        """SGLang's /v1/loads: same keys, same ``include`` and ``dp_rank`` semantics (docs/INTEGRATIONS.md).

        Where SGLang fails, this answers: a bad ``include`` is a 400 with SGLang's message (SGLang
        itself lets the ValueError escape: a 500), a non-integer ``dp_rank`` a 422 as FastAPI's."""
        unknown = sorted(set(query) - {"dp_rank", "format", "include"})
        if unknown:
            raise BadRequest(f"unknown query parameter {unknown[0]!r} for /v1/loads: it accepts {_LOADS_PARAMS}")
        fmt = _single(query, "format", "json")
        if fmt not in ("json", "prometheus"):
            raise BadRequest(f"format={fmt!r} is not supported: use format=json or format=prometheus")
        raw_rank = _single(query, "dp_rank", None)
        dp_rank = None
        if raw_rank is not None:
            digits = raw_rank.strip().lstrip("+-").lstrip("0")
            if _INT.fullmatch(raw_rank.strip()) and len(digits) > MAX_RANK_DIGITS:
                # an integer no rank can be (int() itself refuses past 4,300 digits)
                self._send_json(422, {"detail": [{
                    "type": "int_parsing_size", "loc": ["query", "dp_rank"],
                    "msg": "Unable to parse input string as an integer, exceeded maximum size",
                    "input": raw_rank[:40] + "..."}],
                    "error": f"dp_rank has {len(digits)} digits: no rank is that large; use dp_rank=N"})
                return
            if not _INT.fullmatch(raw_rank.strip()):
                self._send_json(422, {"detail": [{
                    "type": "int_parsing", "loc": ["query", "dp_rank"],
                    "msg": "Input should be a valid integer, unable to parse string as an integer",
                    "input": raw_rank}],
                    "error": f"dp_rank={raw_rank!r} is not an integer: use dp_rank=N"})
                return
            dp_rank = int(raw_rank)
        try:
            include = parse_include(_single(query, "include", None))
        except IncludeError as e:
            self._send_json(400, {"detail": str(e), "error": str(e), "status": 400})
            return
        server = self.server
        if fmt == "prometheus":
            body, gone = server.loads_reply(lambda rec: prometheus_loads(rec, include=include, dp_rank=dp_rank))
        else:
            def render(rec: Any) -> bytes:
                watch = server.watch
                board = watch.board
                doc = loads_document(
                    rec, board=watch.name, generation=board.generation if board is not None else 0,
                    version=dpboard.__version__, include=include, dp_rank=dp_rank,
                    accelerator=server.accelerator, num_accelerators=server.num_accelerators)
                return json_body(doc)

            body, gone = server.loads_reply(render)
        if body is None:
            self._error(503, gone or "the board is gone")
            return
        self._send(200, body, PROMETHEUS_CONTENT_TYPE if fmt == "prometheus" else "application/json")

    def _board(self, query: dict[str, list[str]]) -> None:
        if query:
            raise BadRequest(f"/v1/board takes no query parameters (got {sorted(query)[0]!r})")
        frame = self.server.frame()
        if frame.gone:
            self._error(503, frame.gone)
            return
        self._send_json(200, board_document(frame))

    def _page(self, query: dict[str, list[str]]) -> None:
        """The live page: one self-contained HTML file whose script reads /v1/board once a second."""
        if query:
            raise BadRequest(f"/ takes no query parameters (got {sorted(query)[0]!r})")
        self._send(200, live_page(), "text/html; charset=utf-8")

    def _metrics(self, query: dict[str, list[str]]) -> None:
        if query:
            raise BadRequest(f"/metrics takes no query parameters (got {sorted(query)[0]!r}); "
                             f"use /v1/loads?dp_rank=N&format=prometheus for one rank")
        page = prometheus_text(self.server.sample(), trust_uids=self.server.watch.trust_uids)
        self._send(200, page, CONTENT_TYPE_LATEST)

    def _doctor(self, query: dict[str, list[str]]) -> None:
        """``dpboard doctor``'s findings over the last DOCTOR_WINDOW seconds of this server's samples
        (one per DOCTOR_EVERY at most, taken when this path is asked): {healthy, window_s, findings}."""
        if query:
            raise BadRequest(f"/v1/doctor takes no query parameters (got {sorted(query)[0]!r})")
        doc, gone = self.server.doctor_document()
        if doc is None:
            self._error(503, gone or "the board is gone")
            return
        self._send_json(200, doc)

    def _healthz(self, query: dict[str, list[str]]) -> None:
        if query:
            raise BadRequest(f"/healthz takes no query parameters (got {sorted(query)[0]!r})")
        doc, gone = self.server.health()
        if doc is None:
            self._send_json(503, {"status": "board gone", "board": self.server.watch.name, "error": gone})
            return
        self._send_json(200, doc)


def board_document(frame: Frame) -> dict[str, Any]:
    """``/v1/board``: ``dpboard top --json``'s frame without the rates and the history (they are a
    viewer's, between two of its reads), plus ``version``. Every slot is a row: a STALE one keeps
    its last snapshot; an EMPTY or TORN one has zeros and ``age_s`` null."""
    doc = frame.as_dict()
    for key in ("publish_rate", "request_rate"):
        del doc[key]
    for row in doc["ranks"]:
        row.pop("publish_rate", None)
        row.pop("history", None)
    doc["version"] = dpboard.__version__
    return doc


@functools.cache
def live_page() -> bytes:
    return (Path(__file__).parent / "live.html").read_bytes()


def _single(query: dict[str, list[str]], name: str, default: str | None) -> str | None:
    values = query.get(name)
    if values is None:
        return default
    if len(values) != 1:
        raise BadRequest(f"{name} is given {len(values)} times: give it once")
    return values[0]


# -- the command ---------------------------------------------------------------------------------


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="board name (without the dpboard. prefix)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=count(0, 65535), default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--stale-after", type=stale_after, default=DEFAULT_STALE_AFTER,
                   help="seconds without a publish before a rank is stale (default 1.0)")
    p.add_argument("--wait", action="store_true", help="serve (503) until the board is created")
    p.add_argument("--accelerator", default=None,
                   help="/v1/loads' accelerator name, as SGLang reports it (default: null, SGLang's CPU answer)")
    p.add_argument("--num-accelerators", type=count(0, 2**20), default=1,
                   help="/v1/loads' num_accelerators: accelerators behind one DP rank (default 1)")
    p.add_argument("--trust-uid", type=count(0, 2**32 - 2), action="append", default=[], metavar="UID",
                   help="also serve a board this user created (e.g. 0 for root); repeatable")
    p.add_argument("--header-timeout", type=seconds(3600), default=HEADER_TIMEOUT, metavar="SECONDS",
                   help=f"a request's headers must be whole this long after its first byte, else the "
                        f"connection is closed (default {HEADER_TIMEOUT:g})")
    p.add_argument("--idle-timeout", type=seconds(3600), default=IDLE_TIMEOUT, metavar="SECONDS",
                   help=f"a connection waiting this long for a request is closed (default {IDLE_TIMEOUT:g})")
    p.add_argument("--max-connections", type=count(1, 65536), default=None, metavar="N",
                   help=f"open connections at most; to make room, one that sent nothing goes first, then one "
                        f"still sending its headers, then the one idle longest (default {MAX_CONNECTIONS}; never "
                        f"more than the open-file limit less {FD_RESERVE})")


def run_serve(args: argparse.Namespace) -> int:
    server = LoadsServer(args.name, args.host, args.port, stale_after=args.stale_after, wait=args.wait,
                         accelerator=args.accelerator, num_accelerators=args.num_accelerators,
                         trust_uids=args.trust_uid, header_timeout=args.header_timeout,
                         idle_timeout=args.idle_timeout, max_connections=args.max_connections)

    def stop(signum: int, _frame: Any) -> None:
        # shutdown() waits for serve_forever to return, so it must not run on the serving thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"dpboard serve: board {args.name!r} on {server.url} (the live page at /; /v1/loads, /v1/board, /metrics, "
          f"/healthz)", flush=True)
    started = time.monotonic()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print(f"dpboard serve: stopped after {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0
