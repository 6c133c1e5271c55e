"""``GET /v1/loads``: a board as the JSON document of the loads endpoint."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import dpboard
from dpboard.views.rows import status_of
from dpboard.views.watch import Frame


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
