"""The leaving watcher (dpboard/integrations/sglang/leaving.py) under a real SGLang server (``sglang.launch_server
--dp-size 2`` on the CPU, tests/support/sglang_serving.py), against the two races it must survive:

- **a second server on the same ``DPBOARD_BOARD`` while the first shuts down.** Server A gets SIGTERM to
  its process group (a service manager's stop) with its main process held stopped (SIGSTOP: a main
  process still draining or still killing its tree), so its schedulers are gone and its main process
  still runs: server B started now is refused, with the error naming the board, the live process and
  the fix, and it touches nothing of A's (the plugin's rule: a board whose creator runs is another
  instance's; docs/INTEGRATIONS.md, "When SGLang ends"). Once A's main process has ended, B starts on
  the name (its start replaces A's dead board). A's watcher, held back meanwhile (SIGSTOP: a loaded
  machine that has not run it yet), then sees B's board and ends without touching it or its record and
  without a word; B serves on. B stopped with SIGTERM, nothing of either is left in /dev/shm.
- **the watched pid reused.** Server A is SIGKILLed whole while its watcher is held back, and its main
  process's pid is given to another process at once (``take_pid``: the kernel's ``ns_last_pid``, root
  only; skipped elsewhere). The board's header now names a running pid, but not its start time: the
  watcher, let go, takes the server for ended (it waits on a pidfd taken while the server ran) and the
  board for abandoned, and removes it and the dispatch record while that other process runs.

Every wait is bounded; nothing is timed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dpboard.board import SHM_DIR
from dpboard.board.segment import read_segment_header
from tests.integrations.sglang.serving.conftest import plugin_env, start
from tests.integrations.sglang.test_leaving import take_pid
from tests.support.names import new_board_name
from tests.support.procutil import kill, wait_until
from tests.support.sglang_serving import START_TIMEOUT, STOP_TIMEOUT, Server

pytestmark = [pytest.mark.serving, pytest.mark.timeout(2400)]
EXTRA = ("--load-balance-method", "total_tokens")  # what DPBOARD_METHOD needs (conftest.serving's)
WATCHER = b"dpboard.integrations.sglang.leaving"


def files(name: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"dpboard*.{name}"))


def watcher_of(srv: Server) -> int:
    """The pid of the watcher the server's main process started (its own session: not among srv.pids())."""
    found: list[int] = []

    def look() -> bool:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if WATCHER in argv and b"--pid" in argv and argv[argv.index(b"--pid") + 1] == str(srv.proc.pid).encode():
                found.append(int(entry.name))
                return True
        return False

    assert wait_until(look, timeout=60, interval=0.2), f"no watcher for the server's main process:\n{srv.tail()}"
    return found[0]


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def resume(*pids: int | None) -> None:
    for pid in pids:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def generation(name: str) -> int | None:
    header = read_segment_header(f"/dpboard.{name}")
    return None if header is None else header.generation


def test_a_second_server_on_the_name_while_the_first_shuts_down():
    name = new_board_name()
    env = plugin_env(name)
    a = start(env, extra=EXTRA)
    a_main, a_watcher = a.proc.pid, watcher_of(a)
    a_generation = generation(name)
    b1 = b2 = None
    try:
        assert a_generation is not None
        assert wait_until(lambda: files(name) == [f"dpboard-dispatch.{name}", f"dpboard.{name}"], timeout=120), \
            files(name)  # the DP controller's record: opened at its first dispatch (SGLang's health check)
        os.kill(a_watcher, signal.SIGSTOP)
        os.kill(a_main, signal.SIGSTOP)
        os.killpg(a_main, signal.SIGTERM)  # a service manager's stop; the main process handles it once let go
        assert wait_until(lambda: a.schedulers() == [[], []], timeout=60), (a.schedulers(), a.tail())
        assert running(a_main)

        # B while A's main process runs: refused, naming the board, the process and the fix
        b1 = Server(env, extra=EXTRA)
        try:
            code = b1.proc.wait(timeout=START_TIMEOUT)
        finally:
            b1.kill()
        log = b1.log()
        assert code != 0, log[-4000:]
        assert f"board {name!r} is in use by live process {a_main}" in log, log[-4000:]
        assert "set DPBOARD_BOARD to another name, or stop that process" in log, log[-4000:]
        assert generation(name) == a_generation  # the refused start touched nothing of A's

        # A's main process let go: it ends (SGLang kills its own tree); its watcher is still held back
        resume(a_main)
        a.wait_gone(STOP_TIMEOUT)
        a.kill()
        assert not running(a_main)

        # B once A's processes are gone, before A's watcher has looked: B starts on the name
        b2 = start(env, extra=EXTRA)
        b_generation = generation(name)
        assert b_generation not in (None, a_generation)
        assert read_segment_header(f"/dpboard.{name}").creator_pid == b2.proc.pid
        assert wait_until(lambda: f"dpboard-dispatch.{name}" in files(name), timeout=120), files(name)

        resume(a_watcher)
        assert wait_until(lambda: not running(a_watcher), timeout=120), a.tail()
        assert generation(name) == b_generation
        assert files(name) == [f"dpboard-dispatch.{name}", f"dpboard.{name}"]
        assert "left in /dev/shm" not in a.log(), a.tail()  # A's watcher said nothing of B's board
        status, answer = b2.generate("after the first server ended", 4, timeout=300)
        assert status == 200, answer

        b_watcher = watcher_of(b2)
        b2.stop()  # SIGTERM to its process group
        assert wait_until(lambda: files(name) == [], timeout=120), (files(name), b2.tail())
        assert wait_until(lambda: not running(b_watcher), timeout=60)
    finally:
        resume(a_watcher, a_main)
        for srv in (b2, b1, a):
            if srv is not None:
                srv.kill()
        wait_until(lambda: not running(a_watcher), timeout=60)
        for path in SHM_DIR.glob(f"dpboard*.{name}"):
            path.unlink(missing_ok=True)
        for srv in (a, b1, b2):
            if srv is not None:
                srv.log_path.unlink(missing_ok=True)


def test_the_watched_pid_taken_by_another_process_does_not_keep_the_board():
    name = new_board_name()
    a = start(plugin_env(name), extra=EXTRA)
    a_main, a_watcher = a.proc.pid, watcher_of(a)
    other = None
    try:
        assert wait_until(lambda: f"dpboard-dispatch.{name}" in files(name), timeout=120), files(name)
        os.kill(a_watcher, signal.SIGSTOP)
        a.kill()  # SIGKILL to every process of the server, its main process reaped: its pid is free
        assert files(name) == [f"dpboard-dispatch.{name}", f"dpboard.{name}"]
        other = take_pid(a_main, ["sleep", "600"])
        assert read_segment_header(f"/dpboard.{name}").creator_pid == other.pid  # the board names a running pid

        resume(a_watcher)
        assert wait_until(lambda: files(name) == [], timeout=120), (files(name), a.tail())
        assert other.poll() is None  # the pid's new process ran all along
        assert wait_until(lambda: not running(a_watcher), timeout=60)
        assert f"dpboard: removed dpboard.{name}" in a.log() and f"after SGLang server {a_main} ended" in a.log()
    finally:
        resume(a_watcher)
        if other is not None:
            kill(other)
        a.kill()
        for path in SHM_DIR.glob(f"dpboard*.{name}"):
            path.unlink(missing_ok=True)
        a.log_path.unlink(missing_ok=True)
