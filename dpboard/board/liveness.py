"""Whether a process that a board names (its creator, a slot's writer, a sent-record row's holder, a
collector) still runs.

A pid alone is not an identity: pids are recycled. Every record of a process keeps its start time
in clock ticks since boot beside the pid, and a process counts as alive only when both match. The
rule itself lives in ``dpboard.ownership``, whose lock files name their owners the same way.
"""

from __future__ import annotations

from dpboard.ownership import process_alive, process_exited, process_start_ticks

__all__ = ["process_alive", "process_exited", "process_start_ticks"]
