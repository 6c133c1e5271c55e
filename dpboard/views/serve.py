"""``dpboard serve NAME``: a board over HTTP.

- ``GET /v1/loads`` — JSON shaped like SGLang's loads endpoint:
  ``{"timestamp": ISO-8601 UTC, "version": ..., "loads": [one object per rank]}``;
  ``?dp_rank=N`` keeps one rank, ``?format=prometheus`` answers in the Prometheus text format.
- ``GET /metrics`` — the Prometheus text format (prometheus-client), every rank and the board summary.
- ``GET /healthz`` — 200 while the board is attached, 503 while it is gone.

Bad query parameters get a 400 whose JSON body says what was wrong and what is accepted. The
server is a stdlib ``ThreadingHTTPServer``; a lock serialises reads of the board (the reader's
output array is shared). No Numba import: it starts as fast as ``dpboard dump``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

import dpboard
from dpboard.board import DEFAULT_STALE_AFTER
from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.snapshot import SlotStatus
from dpboard.views.rows import status_of
from dpboard.views.watch import BoardWatch, Frame

# Per-rank gauges: (metric name, row field, help)
_RANK_GAUGES = (
    ("dpboard_num_running_reqs", "num_running_reqs", "Requests in the rank's running batch."),
    ("dpboard_num_waiting_reqs", "num_waiting_reqs", "Requests waiting on the rank (all waiting queues)."),
    ("dpboard_num_used_tokens", "num_used_tokens", "KV tokens in use on the rank."),
    ("dpboard_num_total_tokens", "num_total_tokens", "KV tokens in use plus tokens of requests holding no KV yet."),
    ("dpboard_num_active_tokens", "num_active_tokens", "Total tokens less those still waiting for a KV transfer."),
    ("dpboard_max_total_num_tokens", "max_total_num_tokens", "KV capacity of the rank, in tokens."),
    ("dpboard_token_usage", "token_usage", "Share of the rank's KV capacity in use (0..1)."),
    ("dpboard_snapshot_age_seconds", "age_s", "Seconds since the rank last published."),
)
_RANK_COUNTERS = (
    ("dpboard_received_requests", "num_received_reqs", "Requests the rank has received from the controller."),
    ("dpboard_publishes", "publish_seq", "Snapshots the rank's writer has published."),
)
_STATUSES = tuple(s.label for s in (SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.TORN, SlotStatus.EMPTY))
_LOADS_PARAMS = "dp_rank=N (a rank of the board) and format=json|prometheus"


class BadRequest(InvalidInputError):
    """A query the server refuses with 400; the message names the parameter and the fix."""


def iso_utc(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def load_object(row: dict[str, Any]) -> dict[str, Any]:
    """One rank as /v1/loads shows it: every snapshot field, plus status, token usage and age."""
    has_data = status_of(row).has_snapshot
    out = {k: v for k, v in row.items() if k not in ("history", "publish_rate")}
    out["timestamp"] = iso_utc(row["timestamp_ns"]) if has_data else None
    return out


def loads_document(frame: Frame, dp_rank: int | None = None) -> dict[str, Any]:
    rows = frame.rows if dp_rank is None else [frame.rows[dp_rank]]
    return {
        "timestamp": iso_utc(frame.wall_time_ns),
        "version": dpboard.__version__,
        "board": frame.board,
        "generation": frame.generation,
        "imbalance": frame.imbalance,
        "loads": [load_object(row) for row in rows],
    }


class FrameCollector:
    """A prometheus-client collector for one frame (a fresh registry is built per scrape)."""

    def __init__(self, frame: Frame, dp_rank: int | None = None) -> None:
        self.frame = frame
        self.dp_rank = dp_rank

    def collect(self) -> Iterator[Metric]:
        frame = self.frame
        board = frame.board
        up = GaugeMetricFamily("dpboard_up", "1 while the board is attached, 0 while it is gone.",
                               labels=["board"])
        up.add_metric([board], 0.0 if frame.gone else 1.0)
        yield up
        if frame.gone:
            return
        slots = GaugeMetricFamily("dpboard_slots", "Slots of the board by liveness.", labels=["board", "status"])
        for status in _STATUSES:
            slots.add_metric([board, status], float(frame.counts.get(status, 0)))
        yield slots
        if frame.imbalance is not None:
            imb = GaugeMetricFamily("dpboard_imbalance", "max/mean of total tokens over live ranks.",
                                    labels=["board"])
            imb.add_metric([board], frame.imbalance)
            yield imb
        rows = frame.rows if self.dp_rank is None else [frame.rows[self.dp_rank]]
        state = GaugeMetricFamily("dpboard_slot_status", "1 for the slot's current liveness, 0 for the others.",
                                  labels=["board", "dp_rank", "status"])
        for row in rows:
            for status in _STATUSES:
                state.add_metric([board, str(row["dp_rank"]), status], float(row["status"] == status))
        yield state
        with_data = [row for row in rows if status_of(row).has_snapshot]
        for name, field, help_text in _RANK_GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=["board", "dp_rank"])
            for row in with_data:
                g.add_metric([board, str(row["dp_rank"])], float(row[field]))
            yield g
        for name, field, help_text in _RANK_COUNTERS:
            c = CounterMetricFamily(name, help_text, labels=["board", "dp_rank"])
            for row in with_data:
                c.add_metric([board, str(row["dp_rank"])], float(row[field]))
            yield c


def prometheus_text(frame: Frame, dp_rank: int | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FrameCollector(frame, dp_rank))
    return generate_latest(registry)


class LoadsServer(ThreadingHTTPServer):
    """The HTTP exporter of one board. ``url`` is where it listens; ``serve_forever`` serves."""

    daemon_threads = True

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 8080, *,
                 stale_after: float = DEFAULT_STALE_AFTER, wait: bool = False) -> None:
        if not 0 <= port <= 65535:
            raise InvalidInputError(f"--port must be in 0..65535 (0 picks a free port), got {port}")
        self.watch = BoardWatch(name, stale_after=stale_after, wait=wait)
        self._lock = threading.Lock()
        try:
            super().__init__((host, port), _Handler)
        except OSError as e:
            self.watch.close()
            raise UnavailableError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port "
                               f"(0 picks a free one)") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def sample(self) -> Frame:
        with self._lock:
            return self.watch.sample()

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            self.watch.close()


class _Handler(BaseHTTPRequestHandler):
    server: LoadsServer
    protocol_version = "HTTP/1.1"

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
        self._send(status, (json.dumps(doc) + "\n").encode(), "application/json")

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
        route = {"/v1/loads": self._loads, "/metrics": self._metrics, "/healthz": self._healthz}.get(
            parts.path.rstrip("/") or "/")
        if route is None:
            self._error(404, f"no such path {parts.path!r}: this server has /v1/loads, /metrics and /healthz")
            return
        try:
            route(query)
        except BadRequest as e:
            self._error(400, str(e))

    # -- routes -------------------------------------------------------------------------------

    def _loads(self, query: dict[str, list[str]]) -> None:
        unknown = sorted(set(query) - {"dp_rank", "format"})
        if unknown:
            raise BadRequest(f"unknown query parameter {unknown[0]!r} for /v1/loads: it accepts {_LOADS_PARAMS}")
        fmt = _single(query, "format", "json")
        if fmt not in ("json", "prometheus"):
            raise BadRequest(f"format={fmt!r} is not supported: use format=json or format=prometheus")
        raw_rank = _single(query, "dp_rank", None)
        frame = self.server.sample()
        if frame.gone:
            self._error(503, frame.gone)
            return
        dp_rank = None
        if raw_rank is not None:
            try:
                dp_rank = int(raw_rank)
            except ValueError:
                raise BadRequest(f"dp_rank={raw_rank!r} is not an integer: use dp_rank=N with "
                                 f"0 <= N < {frame.n_slots}") from None
            if not 0 <= dp_rank < frame.n_slots:
                raise BadRequest(f"dp_rank={dp_rank} is out of range: board {frame.board!r} has "
                                 f"{frame.n_slots} ranks (0..{frame.n_slots - 1})")
        if fmt == "prometheus":
            self._send(200, prometheus_text(frame, dp_rank), CONTENT_TYPE_LATEST)
        else:
            self._send_json(200, loads_document(frame, dp_rank))

    def _metrics(self, query: dict[str, list[str]]) -> None:
        if query:
            raise BadRequest(f"/metrics takes no query parameters (got {sorted(query)[0]!r}); "
                             f"use /v1/loads?dp_rank=N&format=prometheus for one rank")
        self._send(200, prometheus_text(self.server.sample()), CONTENT_TYPE_LATEST)

    def _healthz(self, query: dict[str, list[str]]) -> None:
        if query:
            raise BadRequest(f"/healthz takes no query parameters (got {sorted(query)[0]!r})")
        frame = self.server.sample()
        if frame.gone:
            self._send_json(503, {"status": "board gone", "board": frame.board, "error": frame.gone})
            return
        self._send_json(200, {"status": "ok", "board": frame.board, "n_slots": frame.n_slots,
                              "slots": frame.counts, "version": dpboard.__version__})


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
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--stale-after", type=float, default=DEFAULT_STALE_AFTER,
                   help="seconds without a publish before a rank is stale (default 1.0)")
    p.add_argument("--wait", action="store_true", help="serve (503) until the board is created")


def run_serve(args: argparse.Namespace) -> int:
    server = LoadsServer(args.name, args.host, args.port, stale_after=args.stale_after, wait=args.wait)

    def stop(signum: int, _frame: Any) -> None:
        # shutdown() waits for serve_forever to return, so it must not run on the serving thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"dpboard serve: board {args.name!r} on {server.url} (/v1/loads, /metrics, /healthz)", flush=True)
    started = time.monotonic()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print(f"dpboard serve: stopped after {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0
