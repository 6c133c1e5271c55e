"""`dpboard top` against real boards: every slot state, JSON, sorting, a vanishing board, 256 ranks,
and the live view driven in a real terminal (tmux)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from dpboard import Board, LoadSnapshot
from dpboard.views.top import fmt_count, render, render_text, sparkline, usage_bar
from dpboard.views.watch import BoardWatch, imbalance
from tests.controller.test_process_wave import HOLD, two_waves
from tests.support import mixed_board as mixed
from tests.support.names import new_board_name
from tests.support.procutil import kill, read_line
from tests.support.views import heavy_imports_of

pytestmark = pytest.mark.timeout(120)


def dpboard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def mixed_board():
    with mixed.mixed_board(new_board_name()) as b:
        yield b


def rank_lines(text: str) -> dict[int, str]:
    """The table rows of a plain frame, by rank."""
    rows = {}
    for line in text.splitlines():
        first = line.split()[:1]
        if first and first[0].isdigit() and len(line.split()) >= 2 and line.split()[1] in (
                "live", "stale", "torn", "empty"):
            rows[int(first[0])] = line
    return rows


def test_once_shows_every_slot_state(mixed_board):
    proc = dpboard("top", mixed_board.name, "--once", "--stale-after", str(mixed.STALE_AFTER))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\x1b[" not in out  # no escape codes into a pipe
    assert f"board {mixed_board.name}" in out
    assert "4 live" in out and "1 stale" in out and "1 torn" in out and "2 empty" in out
    assert f"imbalance {mixed.expected_imbalance():.2f}x" in out
    rows = rank_lines(out)
    assert sorted(rows) == list(range(8))
    for r in mixed.LIVE_RANKS:
        fields = rows[r].split()
        load = mixed.load_of(r)
        assert fields[1] == "live"
        assert fields[2:6] == [str(load["num_running_reqs"]), str(load["num_waiting_reqs"]),
                               str(load["num_total_tokens"]), str(load["num_active_tokens"])]
        assert f"{load['num_used_tokens'] / mixed.CAPACITY * 100:.0f}%" in rows[r]
        assert str(mixed_board.publisher_pid) in rows[r]
    assert rows[mixed.STALE_RANK].split()[1] == "stale"
    assert str(os.getpid()) in rows[mixed.STALE_RANK]  # this process published it
    assert "writer stopped mid-write" in rows[mixed.TORN_RANK]
    for r in mixed.EMPTY_RANKS:
        assert "never written" in rows[r]
    totals = [mixed.load_of(r) for r in mixed.LIVE_RANKS]
    assert f"running {sum(t['num_running_reqs'] for t in totals)}" in out
    assert f"total tokens {sum(t['num_total_tokens'] for t in totals)}" in out


def test_json_frame(mixed_board):
    proc = dpboard("top", mixed_board.name, "--json", "--stale-after", str(mixed.STALE_AFTER))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["board"] == mixed_board.name and doc["n_slots"] == 8 and doc["gone"] is None
    assert doc["status_counts"] == {"live": 4, "stale": 1, "torn": 1, "empty": 2}
    status = {row["dp_rank"]: row["status"] for row in doc["ranks"]}
    assert status == {0: "live", 1: "live", 2: "live", 3: "live", 4: "stale", 5: "torn", 6: "empty", 7: "empty"}
    for r in mixed.LIVE_RANKS:
        row = doc["ranks"][r]
        for field, value in mixed.load_of(r).items():
            assert row[field] == value, field
        assert row["writer_pid"] == mixed_board.publisher_pid
        assert row["publish_rate"] > 0  # the publisher runs at about 100 Hz
        assert 0 <= row["age_s"] < mixed.STALE_AFTER
    assert doc["ranks"][mixed.STALE_RANK]["age_s"] >= mixed.STALE_AFTER
    assert doc["ranks"][mixed.TORN_RANK]["age_s"] is None
    assert doc["imbalance"] == pytest.approx(mixed.expected_imbalance())
    assert doc["totals"]["live_ranks"] == 4
    assert doc["totals"]["num_total_tokens"] == sum(mixed.load_of(r)["num_total_tokens"] for r in mixed.LIVE_RANKS)
    assert doc["publish_rate"] > 0


def test_sort_by_total_puts_the_busiest_first(mixed_board):
    proc = dpboard("top", mixed_board.name, "--once", "--sort", "total", "--stale-after", str(mixed.STALE_AFTER))
    assert proc.returncode == 0, proc.stderr
    order = [int(line.split()[0]) for line in proc.stdout.splitlines()
             if line.split()[:1] and line.split()[0].isdigit() and len(line.split()) > 1
             and line.split()[1] in ("live", "stale", "torn", "empty")]
    # Highest total first (stale rank 4 has the largest), slots without data last.
    assert order[:5] == [4, 3, 2, 1, 0]
    assert set(order[5:]) == {5, 6, 7}


def test_missing_board_is_a_clear_error():
    proc = dpboard("top", new_board_name(), "--once")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "dpboard ls" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_interval_is_refused(board_name):
    with Board.create(board_name, n_slots=1):
        proc = dpboard("top", board_name, "--interval", "0")
    assert proc.returncode == 2 and "argument --interval: 0 is outside (0, 1e+06] seconds" in proc.stderr


def test_top_does_not_import_numba(mixed_board):
    assert heavy_imports_of("top", mixed_board.name, "--once") == []


def test_vanishing_board_is_reported_and_followed(board_name):
    board = Board.create(board_name, n_slots=2)
    try:
        board.writer(0).publish(LoadSnapshot(dp_rank=0, num_total_tokens=7))
        watch = BoardWatch(board_name)
        first = watch.sample()
        assert first.gone is None and first.rows[0]["num_total_tokens"] == 7
        board.unlink()
        gone = watch.sample()
        assert gone.gone is not None and "is gone" in gone.gone and board_name in gone.gone
        assert "is gone" in render_text(gone)
        assert "is gone" in watch.sample().gone  # still waiting, still the same message
        with Board.create(board_name, n_slots=3) as again:
            again.writer(2).publish(LoadSnapshot(dp_rank=2, num_total_tokens=11))
            back = watch.sample()
            assert back.gone is None and back.n_slots == 3 and back.generation == again.generation
            assert back.rows[2]["num_total_tokens"] == 11 and back.rows[2]["status"] == "live"
        watch.close()
    finally:
        board.close()
        board.unlink()


def test_plain_frames_survive_the_board_vanishing(board_name):
    """Piped (no terminal), the live view prints frames; a removed board is said, not a traceback."""
    board = Board.create(board_name, n_slots=2)
    proc = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "top", board_name, "--interval", "0.1", "-n", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while f"board {board_name}" not in read_line(proc, 30):
            pass  # remove the board only once top has drawn it
        board.close()
        board.unlink()
        after, err = proc.communicate(timeout=60)
    finally:
        kill(proc)
        board.close()
        board.unlink()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "is gone" in after and "waiting for it to come back" in after


def test_256_ranks_fit_the_screen(board_name):
    with Board.create(board_name, n_slots=256) as board:
        for r in range(256):
            board.writer(r).publish(LoadSnapshot(dp_rank=r, num_total_tokens=r * 10, max_total_num_tokens=5000,
                                                 num_used_tokens=r * 10))
        watch = BoardWatch(board_name)
        frame = watch.sample()
        assert frame.counts["live"] == 256
        from io import StringIO

        from rich.console import Console

        buf = StringIO()
        Console(file=buf, width=140, no_color=True).print(render(frame, sort="total", max_rows=30))
        text = buf.getvalue()
        watch.close()
    rows = rank_lines(text)
    assert len(rows) == 30
    assert min(rows) == 226  # the busiest 30, rank 255 first
    assert text.index("255 ") < text.index("254 ")
    assert "226 more ranks below" in text


def test_formatting_keeps_widths():
    assert fmt_count(99_999) == "99999"
    assert fmt_count(123_456) == "123k"
    assert fmt_count(1_234_567) == "1.2M"
    assert all(len(fmt_count(10**k)) <= 6 for k in range(16))
    line = sparkline([0, 5, 10], top=10, width=8)
    assert len(line) == 8 and line.endswith("▁▅█")
    assert usage_bar(0.5, width=10).plain.startswith("█████     ")
    assert usage_bar(1.7, width=10).plain.endswith("100%")
    assert imbalance([]) is None and imbalance([0, 0]) is None
    assert imbalance([1, 3]) == pytest.approx(1.5)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_a_real_terminal(mixed_board):
    socket = f"dpboard-test-{os.getpid()}"
    session = "top"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    command = (f"{sys.executable} -m dpboard.cli top {mixed_board.name} --interval 0.2 "
               f"--stale-after {mixed.STALE_AFTER}; echo TOP-EXITED-$?; sleep 30")
    env = {**os.environ, "TERM": "xterm-256color"}
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "150", "-y", "30", command],
                   check=True, timeout=30, env=env)

    def capture() -> str:
        return subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                              timeout=30).stdout

    try:
        screens = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            screen = capture()
            if "writer stopped mid-write" in screen:
                screens.append(screen)
                if len(screens) >= 2 and screens[-1] != screens[0]:
                    break
            time.sleep(0.3)
        assert screens, f"top never drew a full frame; screen was:\n{capture()}"
        screen = screens[-1]
        assert screen != screens[0], "the view did not refresh"
        assert f"board {mixed_board.name}" in screen and "4 live" in screen and "1 torn" in screen
        rows = rank_lines(screen)
        assert sorted(rows) == list(range(8))
        assert rows[mixed.STALE_RANK].split()[1] == "stale"
        assert "never written" in rows[7]
        assert "Ctrl-C to quit" in screen
        assert screen.count(f"board {mixed_board.name}") == 1  # drawn in place, not scrolled
        subprocess.run([*tmux, "send-keys", "-t", session, "C-c"], check=True, timeout=30)
        deadline = time.monotonic() + 15
        while "TOP-EXITED-" not in capture():
            assert time.monotonic() < deadline, "top did not stop on Ctrl-C"
            time.sleep(0.2)
        assert "TOP-EXITED-0" in capture()
        assert "Traceback" not in capture()
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


# -- boards top cannot read, a board replaced at once, a board of 65,536 ranks ----------------------


def _as_nobody_cmd(*args: str) -> list[str]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run a command as another user (uid 65534)")
    return [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-m", "dpboard.cli",
            *args]


@pytest.mark.parametrize("command", [["top", "--once"], ["top", "--json"], ["serve", "--port", "0"], ["info"]])
def test_a_board_that_cannot_be_read_is_named_for_what_is_wrong(board_name, command):
    """top and serve used to say "does not exist" for a board they could not read; they say what is
    wrong, as info does."""
    path = f"/dev/shm/dpboard.{board_name}"
    with open(path, "wb") as f:
        f.write(b"garbage!" * 100)  # a segment of that name with no board header
    try:
        out = dpboard(command[0], board_name, *command[1:])
        assert out.returncode == 2, out.stdout + out.stderr
        assert "has no dpboard header" in out.stderr and "does not exist" not in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        os.unlink(path)
    with Board.create(board_name, n_slots=2):  # root's, mode 0600
        out = subprocess.run(_as_nobody_cmd(command[0], board_name, *command[1:]), capture_output=True, text=True,
                             timeout=60, cwd="/")
        assert out.returncode == 2, out.stdout + out.stderr
        assert "belongs to uid 0 (root) and is mode 0o600" in out.stderr and "does not exist" not in out.stderr


def test_a_board_replaced_between_two_samples_is_followed(board_name):
    board = Board.create(board_name, n_slots=2)
    watch = BoardWatch(board_name)
    try:
        board.writer(0).publish(LoadSnapshot(dp_rank=0, num_total_tokens=7))
        assert watch.sample().rows[0]["num_total_tokens"] == 7
        board.close()
        board.unlink()
        board = Board.create(board_name, n_slots=2)  # no gap: removed and created before the next sample
        board.writer(0).publish(LoadSnapshot(dp_rank=0, num_total_tokens=8))
        frame = watch.sample()
        assert frame.gone is None and frame.generation == board.generation
        assert frame.rows[0]["num_total_tokens"] == 8
    finally:
        watch.close()
        board.close()
        board.unlink()


def test_once_on_a_board_of_65536_ranks_prints_what_fits(board_name):
    """`top --once` on a 65,536-slot board used to render every rank (94 s); a text frame shows the
    rows that fit (64 without a terminal, or --rows) and says how many are below."""
    with Board.create(board_name, n_slots=65536) as board:
        for r in (0, 5, 65535):
            board.writer(r).publish(LoadSnapshot(dp_rank=r, num_total_tokens=r + 1, max_total_num_tokens=10**6))
        out = dpboard("top", board_name, "--once", "--stale-after", "60")
        assert out.returncode == 0, out.stderr
        rows = rank_lines(out.stdout)
        assert sorted(rows) == list(range(64))
        assert "... 65472 more ranks below" in out.stdout and "--rows" in out.stdout
        out = dpboard("top", board_name, "--once", "--sort", "total", "--rows", "2", "--stale-after", "60")
        assert sorted(rank_lines(out.stdout)) == [5, 65535]  # the busiest, whole rank numbers (no "655…")


def test_a_trusted_board_of_another_user_is_watched_read_only(board_name):
    """`dpboard top --trust-uid 0` by another user on root's 0644 board: attached read-only, and
    sampled again and again without taking it for a replaced board."""
    with Board.create(board_name, n_slots=2, mode=0o644) as board:
        board.writer(1).publish(LoadSnapshot(dp_rank=1, num_total_tokens=42, max_total_num_tokens=100))
        out = subprocess.run(_as_nobody_cmd("top", board_name, "--once", "--trust-uid", "0", "--stale-after", "60"),
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stderr
        assert "42" in rank_lines(out.stdout)[1] and "is gone" not in out.stdout
        refused = subprocess.run(_as_nobody_cmd("top", board_name, "--once"), capture_output=True, text=True,
                                 timeout=60, cwd="/")
        assert refused.returncode == 2 and "--trust-uid 0" in refused.stderr


# -- narrow terminals: columns go whole, RANK and STATE stay ---------------------------------------

@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("columns, kept, dropped", [
    (80, ["RANK", "STATE", "RUN", "WAIT", "TOTAL TOK", "KV USAGE", "AGE"], ["PID", "PUB/S", "HISTORY"]),
    (100, ["RANK", "STATE", "ACTIVE TOK", "KV USAGE", "AGE", "PUB/S"], ["PID", "HISTORY"]),
    (132, ["RANK", "STATE", "ACTIVE TOK", "AGE", "PUB/S", "PID", "HISTORY (total tokens)"], []),
])
def test_live_view_fits_the_terminal_width(mixed_board, columns, kept, dropped):
    screen = _live_screen(mixed_board.name, columns=columns, stale_after=mixed.STALE_AFTER,
                          ready=lambda screen: "Ctrl-C to quit" in screen and len(rank_lines(screen)) == 8)
    rows = rank_lines(screen)
    assert sorted(rows) == list(range(8)), f"not every rank has a row that names it:\n{screen}"
    assert rows[mixed.STALE_RANK].split()[1] == "stale" and rows[mixed.TORN_RANK].split()[1] == "torn"
    assert all(rows[r].split()[1] == "live" for r in mixed.LIVE_RANKS)
    heading = next(line for line in screen.splitlines() if line.lstrip().startswith("RANK"))
    assert "…" not in heading, heading
    for title in kept:
        assert title in heading, (title, heading)
    for title in dropped:
        assert title not in heading, (title, heading)
    assert all(len(line.rstrip()) <= columns for line in screen.splitlines())
    assert "…" not in "".join(rows.values())  # no cell is cut: a column is there whole or not at all
    # the header's doctor line (the stale and torn ranks' finding) is wrapped whole, never cut
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("doctor: "))
    end = next(i for i, line in enumerate(lines) if line.lstrip().startswith("RANK"))
    doctor = " ".join(line.strip() for line in lines[start:end] if line.strip())
    assert "…" not in doctor and doctor.endswith("(dpboard doctor for the evidence)"), doctor


def test_wait_with_once_and_json_waits_for_the_board_then_prints_one_frame(board_name):
    for flag in ("--once", "--json"):
        name = f"{board_name}{flag[2]}"
        proc = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "top", name, "--wait", flag, "--wait-timeout", "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # it says it waits, and waits: the board is created only after that line
            assert "waiting for it to be created" in proc.stderr.readline()
            assert proc.poll() is None
            with Board.create(name, n_slots=2) as board:
                board.writer(1).publish(LoadSnapshot(dp_rank=1, num_running_reqs=7, num_total_tokens=4321))
                out, _ = proc.communicate(timeout=60)
        finally:
            kill(proc)
        assert proc.returncode == 0, out
        if flag == "--json":
            doc = json.loads(out)
            assert doc["board"] == name and doc["ranks"][1]["num_total_tokens"] == 4321
        else:
            assert f"board {name}" in out and "4321" in rank_lines(out)[1]


def test_wait_with_once_gives_up_after_its_timeout(board_name):
    proc = dpboard("top", board_name, "--wait", "--once", "--wait-timeout", "0.3")
    assert proc.returncode == 2 and "was not created within 0.3 s" in proc.stderr and "Traceback" not in proc.stderr


# -- an inflight_wave controller's hold ----------------------------------------------------------------

WAVE_LINE = re.compile(r"^wave +held 5 \(0 now\) +waves 2 +released full 4, bound 1 +hold max ([0-9.]+) s of 1.5 s, "
                       r"mean ([0-9.]+) s +held max 0.0 MiB", re.M)


def test_top_shows_the_wave_of_a_real_controller(board_name, tmp_path):
    """An inflight_wave controller's hold was in no view. top's header says it, from the controller's
    row of the board's dispatch record: the frame printed (--once), --json, and the live view in a real
    terminal (tmux)."""
    with two_waves(board_name, tmp_path):
        once = dpboard("top", board_name, "--once", "--stale-after", "60")
        as_json = dpboard("top", board_name, "--json", "--stale-after", "60")
        screen = _live_screen(board_name, ready=lambda screen: "waves 2" in screen and "Ctrl-C to quit" in screen) if shutil.which("tmux") else None
    assert once.returncode == 0, once.stderr
    found = WAVE_LINE.search(once.stdout)
    assert found, once.stdout
    assert HOLD - 0.05 <= float(found.group(1)) < HOLD + 1.0
    assert sorted(rank_lines(once.stdout)) == [0, 1]  # the rows as before
    (wave,) = json.loads(as_json.stdout)["waves"]
    assert (wave["row"], wave["method"], wave["held"], wave["holding"], wave["waves"]) == (0, "inflight_wave", 5, 0, 2)
    assert wave["released"] == {"full": 4, "bytes": 0, "busy": 0, "bound": 1, "shutdown": 0, "order": 0}
    assert wave["max_hold_s"] == HOLD and wave["hold_max_s"] == pytest.approx(float(found.group(1)), abs=0.01)
    if screen is not None:
        assert WAVE_LINE.search(screen), screen
        assert screen.count(f"board {board_name}") == 1 and sorted(rank_lines(screen)) == [0, 1]


def _live_screen(name: str, *, ready: Callable[[str], bool], columns: int = 150, stale_after: float = 60.0) -> str:
    """What `dpboard top NAME` draws in a real terminal (tmux, ``columns`` x 30) once ``ready`` says
    so of the screen, or after 30 s."""
    socket = f"dpboard-test-{os.getpid()}-{next(_SOCKETS)}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    command = f"{sys.executable} -m dpboard.cli top {name} --interval 0.2 --stale-after {stale_after}; sleep 30"
    env = {**os.environ, "TERM": "xterm-256color"}
    subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", str(columns), "-y", "30", command],
                   check=True, timeout=30, env=env)
    try:
        deadline = time.monotonic() + 30
        screen = ""
        while time.monotonic() < deadline:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                                    timeout=30).stdout
            if ready(screen):
                break
            time.sleep(0.3)
        return screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


_SOCKETS = itertools.count()  # a tmux server of its own per screen
