"""Helpers of the view tests (no tests of its own).

``dpboard doctor``'s samples as ``take_sample`` makes them from a real board, built by hand so that
each of the doctor's rules can be put in the one state it judges: ``rank_row(k, ...)`` is one slot
of a ``Sample`` (a live rank of 1000 tokens by default), ``pd_queues(mode, ...)`` its
disaggregation detail, ``dispatch_row(...)`` one dispatcher's row of the dispatch record,
``sample(t, ranks, ...)`` the whole read at ``t`` seconds.

``heavy_imports_of(*argv)`` runs a dpboard command in a fresh interpreter and names the Numba,
CuPy and llvmlite modules it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from dpboard.board.dispatch_record import COUNTERS, DispatchRowSample
from dpboard.views.doctor import Sample

WRITER_PID = 4242  # the pid every hand-made slot names as its writer


def rank_row(k: int, status: str = "live", *, total: int = 1000, used: int = 1000, cap: int = 10_000,
             running: int = 2, waiting: int = 0, received: int = 0, seq: int = 1, pid: int = WRITER_PID,
             pid_alive: bool = True, age_s: float | None = 0.01, pd: dict[str, Any] | None = None) -> dict[str, Any]:
    """One slot as ``take_sample`` reads it (``status``: live, stale, torn or empty)."""
    has_data = status in ("live", "stale")
    return {
        "rank": k, "status": status, "pid": pid, "owner_pid": pid if status != "empty" else 0,
        "pid_alive": pid_alive, "age_s": age_s if has_data else None,
        "num_running_reqs": running, "num_waiting_reqs": waiting, "num_used_tokens": used,
        "num_total_tokens": total, "max_total_num_tokens": cap, "num_received_reqs": received,
        "publish_seq": seq, "pd": pd,
    }


def pd_queues(mode: str, *, bootstrap: int = 0, inflight: int = 0, prealloc: int = 0,
              transfer: int = 0) -> dict[str, Any]:
    """A slot's disaggregation detail: its mode and its four PD queues."""
    return {"mode": mode, "prefill_bootstrap_queue_reqs": bootstrap, "prefill_inflight_queue_reqs": inflight,
            "decode_prealloc_queue_reqs": prealloc, "decode_transfer_queue_reqs": transfer}


def dispatch_row(n_slots: int, *, row: int = 0, pid: int = 5151, alive: bool = True,
                 method: str = "total_tokens", mode: str = "null", refresh_interval: float = 0.02,
                 age_s: float = 0.01, per_rank: list[int] | None = None, routed_per_rank: list[int] | None = None,
                 **counts: int) -> DispatchRowSample:
    """One dispatcher's row; ``counts`` are its cumulative counters (the others 0)."""
    unknown = set(counts) - set(COUNTERS)
    assert not unknown, f"no such counter: {unknown}"
    return DispatchRowSample(row=row, pid=pid, alive=alive, method=method, mode=mode,
                             refresh_interval=refresh_interval, age_s=age_s, wall_ns=0,
                             counts={name: counts.get(name, 0) for name in COUNTERS},
                             per_rank=per_rank if per_rank is not None else [0] * n_slots,
                             routed_per_rank=routed_per_rank if routed_per_rank is not None else [0] * n_slots)


def sample(t: float, ranks: list[dict[str, Any]], *, board: str = "doctor-rules",
           dispatch: list[DispatchRowSample] | None = None, refused: str | None = None,
           in_flight: list[int] | None = None) -> Sample:
    """The read of a board of ``len(ranks)`` slots at ``t`` seconds."""
    return Sample(t, board, len(ranks), ranks, dispatch, refused, in_flight)


HEAVY = ("numba", "cupy", "llvmlite")  # what the read-only views never import (docs/ARCHITECTURE.md)


def heavy_imports_of(*argv: str) -> list[str]:
    """``dpboard ARGV`` run to its end in a fresh interpreter (it must exit 0): the modules of
    ``HEAVY`` it imported on the way, lazy imports included."""
    code = ("import json, sys; from dpboard.cli import main; rc = main(sys.argv[1:]); "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])
