"""``GET /metrics``: a board in the Prometheus text format (prometheus-client), every rank and the
board's summary.

Names follow Prometheus's conventions: ``dpboard_`` first, the unit last (``_tokens``,
``_requests``, ``_seconds``), ratios in ``_ratio``, counters in ``_total``, no ``num_``. Beside
them, three series carry the names SGLang's model gateway looks for when it falls back from
``/v1/loads`` to ``/metrics`` (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage``): the gateway sums the first two and averages the third over every sample,
so they are per rank like the others. Their colon breaks the naming convention (colons are meant
for recording rules), and that is the point: it is the name the gateway reads.

Where a dispatcher of the board holds arrivals for waves (``inflight_wave``: ``dpboard controller``,
the SGLang plugin), its hold's counters follow, per row of the board's dispatch record (label
``row``), read from the record as ``dpboard doctor`` reads it: requests held and held now, waves,
releases by reason, how long requests were held (a summary, its ``_count`` the released requests)
and the longest hold against its budget, bytes held now and the most held at once.

``/v1/loads?format=prometheus`` is another page with another purpose (SGLang's loads endpoint);
docs/TOOLS.md has both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import generate_latest

from dpboard.board.dispatch_record import WAVE_REASONS, DispatchRowSample, read_wave_rows
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
# An inflight_wave dispatcher's hold, per row of the dispatch record: (family, name, WaveCounts field, help).
_WAVE_SERIES = (
    (CounterMetricFamily, "dpboard_wave_held_requests", "held", "Requests the dispatcher held for a wave."),
    (GaugeMetricFamily, "dpboard_wave_holding_requests", "holding", "Requests held for a wave now."),
    (CounterMetricFamily, "dpboard_waves", "waves", "Waves the dispatcher released."),
    (GaugeMetricFamily, "dpboard_wave_hold_max_seconds", "hold_max_s", "The longest one request was held."),
    (GaugeMetricFamily, "dpboard_wave_hold_bound_seconds", "max_hold_s",
     "The hold's budget (--wave-max-hold): a request is held at most this less one group step."),
    (GaugeMetricFamily, "dpboard_wave_held_bytes", "held_bytes", "Bytes of the requests held now."),
    (GaugeMetricFamily, "dpboard_wave_held_max_bytes", "held_bytes_max", "The most bytes held at once."),
)


class FrameCollector:
    """A prometheus-client collector for one frame (a fresh registry is built per scrape)."""

    def __init__(self, frame: Frame, dp_rank: int | None = None, waves: list[DispatchRowSample] | None = None) -> None:
        self.frame = frame
        self.dp_rank = dp_rank
        self.waves = waves or []  # the dispatch record's rows that hold for waves (read_wave_rows)

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
        if self.waves:
            yield from _wave_metrics(board, self.waves)


def _per_rank(family: Any, name: str, help_text: str, board: str, field: str,
              rows: list[dict[str, Any]]) -> Metric:
    metric = family(name, help_text, labels=["board", "dp_rank"])
    for row in rows:
        metric.add_metric([board, str(row["dp_rank"])], float(row[field]))
    return metric


def _wave_metrics(board: str, rows: list[DispatchRowSample]) -> Iterator[Metric]:
    """Each wave row's counters, labelled with the board and the row."""
    labels = ["board", "row"]
    for family, name, field, help_text in _WAVE_SERIES:
        metric = family(name, help_text, labels=labels)
        for row in rows:
            metric.add_metric([board, str(row.row)], float(getattr(row.wave, field)))
        yield metric
    released = CounterMetricFamily("dpboard_wave_released_requests",
                                   "Held requests released, by why their wave left.", labels=[*labels, "reason"])
    hold = SummaryMetricFamily("dpboard_wave_hold_seconds", "Seconds each released request was held.", labels=labels)
    for row in rows:
        for reason, count in zip(WAVE_REASONS, row.wave.released, strict=True):
            released.add_metric([board, str(row.row), reason], float(count))
        hold.add_metric([board, str(row.row)], count_value=sum(row.wave.released), sum_value=row.wave.hold_sum_s)
    yield released
    yield hold


def prometheus_text(frame: Frame, dp_rank: int | None = None, *, trust_uids: tuple[int, ...] = ()) -> bytes:
    """The page: every rank, or only ``dp_rank``; the wave's counters of the board's dispatch record
    (``trust_uids``: also a record those users made, as for the board)."""
    waves = read_wave_rows(frame.board, trust_uids=trust_uids) if frame.gone is None else []
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FrameCollector(frame, dp_rank, waves))
    return generate_latest(registry)
