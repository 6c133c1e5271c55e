"""A deployment's way out: nothing of its board is left in /dev/shm once its processes are gone.

``vllm serve`` stops its processes hard: at SIGTERM or Ctrl-C its launcher sends SIGTERM to the API
servers, the engine cores and the coordinator, and SIGKILLs whatever still runs right after
(``--shutdown-timeout`` 0, the default; vllm/v1/engine/utils.py, the process managers' ``shutdown``).
Engine cores are forked, and a forked child never runs ``atexit``. So the board (created by the
first API server or engine core to open it), the API servers' sent record and their dispatch record
outlive the processes that would remove them. The plugin therefore removes them in three places:

- each engine core and each API server, on vLLM's own shutdown path, gives up its slot or its rows
  and removes what no other process of the deployment still holds (engine_core.py, dispatch.py);
- the launcher (the process that runs ``vllm serve``: every other process of the deployment is its
  child, and it outlives them all) removes, at its exit, the board and the records of this
  deployment that no live process holds: ``at_launcher_exit``.

"Nothing of it lives" is dpboard's one rule for its files, the one ``dpboard clean`` applies
(docs/FORMAT.md, "Liveness"): a board none of whose slots was published within the stale threshold,
on which no process holds a lock (its creator's, a slot writer's) and whose creator does not run; a
sent record none of whose rows is held, a dispatch record none of whose dispatchers runs. A board
one of whose processes runs, in this PID namespace or another, is never touched.

The launcher waits only for what it may remove: this user's files, and a board this deployment made
(its creator started after the launcher). Another user's file under the name (anybody may leave
one) and an older deployment's board of that name are left alone at once, never waited for.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import time
from collections.abc import Mapping

from dpboard.board import SEGMENT_PREFIX, SHM_DIR, validate_name
from dpboard.board.listing import own_files, read_listing, remove_if_gone
from dpboard.board.liveness import process_start_ticks
from dpboard.errors import DpboardError
from dpboard.integrations.vllm.settings import DERIVED_PREFIX, ENV_BOARD, ENV_ENABLE

log = logging.getLogger("dpboard.vllm")
# seconds the launcher waits at its exit for the processes it has just killed to be gone (an engine
# core of several GB takes a moment to exit after SIGKILL)
EXIT_WAIT = 15.0


def deployment_boards(environ: Mapping[str, str]) -> list[str]:
    """The boards this deployment may have made: the one ``DPBOARD_VLLM_BOARD`` names, or with
    ``DPBOARD_VLLM=1`` every ``vllm-*`` board here (named after a served model, which the launcher
    does not see)."""
    explicit = environ.get(ENV_BOARD, "").strip()
    if explicit:
        try:
            return [validate_name(explicit)]
        except DpboardError:
            return []
    if environ.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on"):
        return sorted(p.name[len(SEGMENT_PREFIX):] for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}{DERIVED_PREFIX}*"))
    return []


def watch_from_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """In the process that launches the deployment (no multiprocessing parent: ``vllm serve`` itself,
    not an API server, engine core or worker it started), remove at exit what the deployment left
    (``at_launcher_exit``). True when registered."""
    if multiprocessing.parent_process() is not None:
        return False
    if not (environ.get(ENV_BOARD, "").strip() or environ.get(ENV_ENABLE, "").strip()):
        return False
    pid = os.getpid()
    atexit.register(at_launcher_exit, pid, process_start_ticks(pid), dict(environ))
    return True


def at_launcher_exit(pid: int, started: int, environ: Mapping[str, str]) -> None:
    if os.getpid() != pid:
        return  # a forked child (an engine core) never runs atexit; a forked one that did is not the launcher
    deadline = time.monotonic() + EXIT_WAIT
    for name in deployment_boards(environ):
        removed: list[str] = []
        try:
            while True:
                # vLLM SIGKILLs its children and never joins them: reap the ones that have exited (a
                # zombie still counts as running), through multiprocessing's own bookkeeping
                multiprocessing.active_children()
                removed += remove_if_gone(name, started_after=started)
                left = files_of(name, started)
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.1)  # killed a moment ago: a process of several GB takes a while to exit
        except Exception:  # noqa: BLE001 - at exit: say it, never fail the launcher's exit
            log.exception("dpboard: board %r was not cleaned up at exit", name)
            continue
        if removed:
            log.info("dpboard: removed %s, left by the deployment's processes", ", ".join(removed))
        if left:
            log.warning("dpboard: %s still held by running processes at exit; `dpboard clean` removes them "
                        "once those are gone", ", ".join(left))


def files_of(name: str, started: int = 0) -> list[str]:
    """What of board ``name`` in /dev/shm the launcher waits for: the board, its sent record, its
    dispatch record, of this user only (another user's file under such a name is never removed from
    here), and the board only when this deployment made it (a readable header whose creator started
    at ``started`` clock ticks since boot or later: an older deployment's board stays, so does a
    file with no board header)."""
    left = []
    for file in own_files(name):
        if file == SEGMENT_PREFIX + name:
            try:
                header = read_listing(name).header
            except DpboardError:
                continue  # gone meanwhile
            if header is None or header.creator_start_ticks < started:
                continue
        left.append(file)
    return left
