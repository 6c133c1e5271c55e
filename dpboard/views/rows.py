"""The one row model every view shares: a board slot as a plain dict, and how its status and age read.

``slot_rows`` reads every slot into one dict (every snapshot field, ``status`` as its label,
``token_usage`` and ``age_s``); ``dpboard dump``, ``info``, ``top``, ``serve`` and the demo all show
these rows, so a field or a status means the same everywhere. The rows come from the C reader's
plain values (``read_with_status``), so a command that shows them needs no NumPy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpboard.snapshot import FIELD_NAMES, SlotStatus, token_usage

if TYPE_CHECKING:
    from dpboard.board import BoardReader

_NO_SNAPSHOT = dict.fromkeys(FIELD_NAMES, 0)  # an EMPTY or TORN slot's fields, as read_array gives them


def slot_rows(reader: BoardReader) -> list[dict[str, Any]]:
    """One dict per slot, every snapshot field plus status (its label), token usage and age (seconds;
    negative for a stamp ahead of this process's clock, which reads as STALE beyond ``stale_after``)."""
    reads = [reader.read_with_status(rank) for rank in range(reader.n_slots)]
    now_mono = time.monotonic_ns()
    rows = []
    for rank, (status, snap) in enumerate(reads):
        row: dict[str, Any] = dict(zip(FIELD_NAMES, snap, strict=True)) if snap is not None else {
            **_NO_SNAPSHOT, "dp_rank": rank}
        row["status"] = status.label
        row["token_usage"] = token_usage(row["num_used_tokens"], row["max_total_num_tokens"])
        row["age_s"] = (now_mono - row["monotonic_ns"]) / 1e9 if status.has_snapshot else None
        rows.append(row)
    return rows


def in_flight(board: str, generation: int, received: Sequence[int], *,
              trust_uids: tuple[int, ...] = ()) -> list[int] | None:
    """Per slot, the requests sent to it and not yet received, over every sender (vLLM's API servers):
    ``sent - num_received_reqs - base`` from the board's sent record (never below 0), as the senders
    themselves count it; None where the board has no sent record (none is created: it is read-only)
    or dpboard refuses the file there. ``received``: each slot's ``num_received_reqs``."""
    from dpboard.board.sent import read_sent
    from dpboard.errors import DpboardError

    try:
        found = read_sent(board, generation=generation, trust_uids=trust_uids)
    except DpboardError:
        return None  # a file dpboard does not read (another user's, damaged): no count to show
    if found is None:
        return None
    sent, base = found
    return [max(0, sent[k] - got - base[k]) if k < len(sent) else 0 for k, got in enumerate(received)]


def status_of(row: dict[str, Any]) -> SlotStatus:
    """The SlotStatus of a row made by ``slot_rows``."""
    return SlotStatus[row["status"].upper()]


def status_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many rows are in each status, every status present (keys are the labels)."""
    counts = {s.label: 0 for s in SlotStatus}
    for row in rows:
        counts[row["status"]] += 1
    return counts


def fmt_age(age: float | None) -> str:
    """A snapshot's age in at most 5 characters: ms below a second, then s, m, h; "ahead" for a
    stamp ahead of this clock (a writer whose monotonic clock runs ahead: never a real age)."""
    if age is None:
        return "-"
    if age < 0:
        return "ahead"
    if age < 1:
        return f"{age * 1e3:.0f}ms"
    if age < 600:
        return f"{age:.1f}s"
    if age < 36_000:
        return f"{age / 60:.0f}m"
    return f"{age / 3600:.0f}h"
