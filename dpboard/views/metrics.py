"""``GET /metrics``: a board in the Prometheus text format (prometheus-client), every rank and the
board's summary, under dpboard's own metric names."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from dpboard.snapshot import SlotStatus
from dpboard.views.rows import status_of
from dpboard.views.watch import Frame

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
