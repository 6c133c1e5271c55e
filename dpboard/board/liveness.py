"""Whether a process that a board names (its creator, a slot's writer, a collector) still runs.

A pid alone is not an identity: pids are recycled. Every record of a process keeps its start time
in clock ticks since boot beside the pid, and a process counts as alive only when both match.
"""

from __future__ import annotations

from pathlib import Path

from dpboard.ownership import pid_alive


def process_start_ticks(pid: int) -> int:
    """Start time of a process in clock ticks since boot (0 when it does not exist)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def process_alive(pid: int, start_ticks: int = 0) -> bool:
    """True when ``pid`` runs (and, when ``start_ticks`` is given, started at that time)."""
    if not pid_alive(pid):
        return False
    if start_ticks:
        return process_start_ticks(pid) == start_ticks
    return True
