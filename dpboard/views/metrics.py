"""``GET /metrics``: a board in the Prometheus text format (prometheus-client), every rank and the
board's summary.

Names follow Prometheus's conventions: ``dpboard_`` first, the unit last (``_tokens``,
``_requests``, ``_seconds``), ratios in ``_ratio``, counters in ``_total``, no ``num_``. Beside
them, three series carry the names SGLang's model gateway looks for when it falls back from
``/v1/loads`` to ``/metrics`` (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage``): the gateway sums the first two and averages the third over every sample,
so they are per rank like the others. Their colon breaks the naming convention (colons are meant
for recording rules), and that is the point: it is the name the gateway reads.

``/v1/loads?format=prometheus`` is another page with another purpose (SGLang's loads endpoint);
docs/TOOLS.md has both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from dpboard.snapshot import SlotStatus
from dpboard.views.rows import status_of
from dpboard.views.watch import Frame

# Per-rank gauges: (metric name, row field, help). Samples only for ranks with a snapshot.
_RANK_GAUGES = (
    ("dpboard_running_requests", "num_running_reqs", "Requests in the rank's running batch."),
    ("dpboard_waiting_requests", "num_waiting_reqs", "Requests waiting on the rank (every waiting queue)."),
    ("dpboard_used_tokens", "num_used_tokens", "KV cache tokens in use on the rank."),
    ("dpboard_total_tokens", "num_total_tokens",
     "KV cache tokens in use plus the tokens of requests that hold no KV yet (the rank's token load)."),
    ("dpboard_active_tokens", "num_active_tokens",
     "Total tokens less those of requests still waiting for a KV transfer (PD decode)."),
    ("dpboard_capacity_tokens", "max_total_num_tokens", "KV cache capacity of the rank, in tokens."),
    ("dpboard_snapshot_age_seconds", "age_s", "Seconds since the rank last published."),
)
# Ratios: no sample for a rank whose capacity is unknown (0), since 0 would read as an idle rank.
_RANK_RATIOS = (
    ("dpboard_token_usage_ratio", "token_usage", "Share of the rank's KV cache capacity in use (0 to 1)."),
)
# Counters, exposed with the _total suffix.
_RANK_COUNTERS = (
    ("dpboard_received_requests", "num_received_reqs", "Requests the rank has received from the controller."),
    ("dpboard_publishes", "publish_seq", "Snapshots the rank's writer has published."),
)
# SGLang's model gateway, /metrics fallback: the names it reads (sum, sum, mean over the samples).
_GATEWAY_GAUGES = (
    ("sglang:num_running_reqs", "num_running_reqs", "Running requests, as SGLang's model gateway reads them."),
    ("sglang:num_queue_reqs", "num_waiting_reqs", "Waiting requests, as SGLang's model gateway reads them."),
)
_GATEWAY_RATIOS = (
    ("sglang:token_usage", "token_usage", "KV cache usage (0 to 1), as SGLang's model gateway reads it."),
)
_STATUSES = tuple(s.label for s in (SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.TORN, SlotStatus.EMPTY))


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
            imb = GaugeMetricFamily("dpboard_imbalance_ratio",
                                    "max/mean of total tokens over live ranks (1 is perfectly even).",
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
        with_capacity = [row for row in with_data if row["max_total_num_tokens"] > 0]
        for family, table, samples in (
            (GaugeMetricFamily, _RANK_GAUGES, with_data),
            (GaugeMetricFamily, _RANK_RATIOS, with_capacity),
            (CounterMetricFamily, _RANK_COUNTERS, with_data),
            (GaugeMetricFamily, _GATEWAY_GAUGES, with_data),
            (GaugeMetricFamily, _GATEWAY_RATIOS, with_capacity),
        ):
            for name, field, help_text in table:
                yield _per_rank(family, name, help_text, board, field, samples)


def _per_rank(family: Any, name: str, help_text: str, board: str, field: str,
              rows: list[dict[str, Any]]) -> Metric:
    metric = family(name, help_text, labels=["board", "dp_rank"])
    for row in rows:
        metric.add_metric([board, str(row["dp_rank"])], float(row[field]))
    return metric


def prometheus_text(frame: Frame, dp_rank: int | None = None) -> bytes:
    """The page: every rank, or only ``dp_rank``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FrameCollector(frame, dp_rank))
    return generate_latest(registry)
