"""``dpboard doctor`` on real boards put into each state it diagnoses: writer processes publishing
(tests/support/doctor_states.py, tests/support/mixed_board.py) and a real ZMQ controller with
scheduler processes (tests/support/fake_scheduler.py), ``dpboard doctor`` itself run as a process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from dpboard import Board
from dpboard.board.dispatch_record import dispatch_record_path, read_dispatch_record
from dpboard.controller.codec import encode_request
from dpboard.errors import DpboardError
from dpboard.ownership import LOCK_DIR, LOCK_PREFIX
from tests.support.doctor_states import start_writer
from tests.support.mixed_board import STALE_AFTER, STALE_RANK, TORN_RANK, mixed_board
from tests.support.names import ROOT
from tests.support.procutil import kill, stop, wait_for
from tests.support.sockets import connected_push

FINDING_KEYS = {"id", "severity", "title", "evidence", "cause", "fix"}


@pytest.fixture(autouse=True)
def no_leaked_record(board_name):
    """No test leaves its board's dispatch record behind (the suite's leak check sees boards only)."""
    yield
    path = Path(dispatch_record_path(board_name))
    leaked = path.exists()
    path.unlink(missing_ok=True)
    assert not leaked, f"{path} was left behind"


def doctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", "doctor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def doctor_json(name: str, window: float = 1.0, *extra: str) -> tuple[int, dict]:
    res = doctor(name, "--window", str(window), "--json", *extra)
    assert res.returncode in (0, 1), res.stderr
    report = json.loads(res.stdout)
    assert isinstance(report["healthy"], bool) and report["healthy"] == (res.returncode == 0)
    assert isinstance(report["window_s"], float) and report["window_s"] >= window * 0.9
    for f in report["findings"]:
        assert set(f) == FINDING_KEYS and all(isinstance(v, str) and v for k, v in f.items() if k != "id")
        assert f["severity"] in ("critical", "warning", "info")
    order = ["critical", "warning", "info"]
    assert [order.index(f["severity"]) for f in report["findings"]] == sorted(
        order.index(f["severity"]) for f in report["findings"])  # most serious first
    return res.returncode, report


def by_id(report: dict) -> dict[str, dict]:
    return {f["id"]: f for f in report["findings"]}


@contextlib.contextmanager
def writers(name: str, n_slots: int, per_rank: dict[int, list[str]]) -> Iterator[list[subprocess.Popen]]:
    board = Board.create(name, n_slots)
    procs: list[subprocess.Popen] = []
    try:
        for rank, args in per_rank.items():
            procs.append(start_writer(name, rank, *args))
        yield procs
    finally:
        for p in procs:
            kill(p)
        board.close()
        board.unlink()


# -- the board alone -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_even_live_ranks_are_healthy_and_exit_0(board_name):
    with writers(board_name, 3, {r: [] for r in range(3)}):
        status, report = doctor_json(board_name)
        text = doctor(board_name, "--window", "0.5")
    assert status == 0, report
    assert [f["id"] for f in report["findings"]] == ["no_record"]  # an info note: not a fault
    assert report["status_counts"]["live"] == 3
    assert text.returncode == 0 and "healthy: no findings" in text.stdout


@pytest.mark.timeout(60)
def test_one_slot_is_named_as_dp_size_1(board_name):
    with writers(board_name, 1, {0: []}):
        status, report = doctor_json(board_name)
    assert status == 1
    assert by_id(report)["one_slot"]["severity"] == "warning"
    assert "dp-size" in by_id(report)["one_slot"]["fix"]


@pytest.mark.timeout(60)
def test_only_one_live_rank_and_the_stale_ranks_gone_pids(board_name):
    with writers(board_name, 3, {0: []}) as procs:
        gone = [start_writer(board_name, r, "--once") for r in (1, 2)]
        for p in gone:
            assert p.wait(10) == 0
        procs.extend(gone)
        time.sleep(1.2)  # past the default 1 s stale threshold
        status, report = doctor_json(board_name)
    assert status == 1
    found = by_id(report)
    assert found["one_live_rank"]["severity"] == "critical"
    assert "only 1 of 3 ranks live (rank 0)" == found["one_live_rank"]["title"]
    stale = found["stale_or_torn"]
    assert stale["severity"] == "critical"  # their writers are gone
    for p, rank in zip(gone, (1, 2), strict=True):
        assert f"rank {rank} stale" in stale["evidence"] and f"pid {p.pid} gone" in stale["evidence"]


@pytest.mark.timeout(90)
def test_stale_and_torn_ranks_with_their_pids(board_name):
    import os

    with mixed_board(board_name) as mixed:
        status, report = doctor_json(board_name, 1.0, "--stale-after", str(STALE_AFTER))
        board = Board.attach(board_name)
        torn_owner = board.owner_pid(TORN_RANK)
        board.close()
        del mixed
    assert status == 1
    f = by_id(report)["stale_or_torn"]
    assert f["severity"] == "critical"
    assert f"rank {STALE_RANK} stale" in f["evidence"] and f"pid {os.getpid()} running" in f["evidence"]
    assert f"rank {TORN_RANK} torn (pid {torn_owner} gone)" in f["evidence"]
    assert "one_live_rank" not in by_id(report)  # four ranks are live


@pytest.mark.timeout(60)
def test_kv_saturation_on_some_ranks_only(board_name):
    with writers(board_name, 3, {0: ["--used", "9600"], 1: ["--used", "2000"], 2: ["--used", "2500"]}):
        status, report = doctor_json(board_name)
    assert status == 1
    f = by_id(report)["kv_saturation"]
    assert f["title"] == "KV cache full on rank 0 only"
    assert "rank 0 96%" in f["evidence"] and "rank 1 20%" in f["evidence"]


@pytest.mark.timeout(60)
def test_evenly_full_kv_is_not_saturation_on_some_ranks(board_name):
    with writers(board_name, 2, {0: ["--used", "9600"], 1: ["--used", "9500"]}):
        _, report = doctor_json(board_name)
    assert "kv_saturation" not in by_id(report)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("growth", [40.0, 0.0])
def test_decode_transfer_queues_growing_while_prefill_idles(board_name, growth):
    decode = ["--pd", "decode", "--transfer-growth", str(growth)]
    prefill = ["--pd", "prefill", "--running", "0"]
    with writers(board_name, 4, {0: decode, 1: decode, 2: prefill, 3: prefill}):
        _, report = doctor_json(board_name, 1.5)
    found = by_id(report)
    if growth == 0:
        assert "pd_rendezvous" not in found
        return
    f = found["pd_rendezvous"]
    assert f["severity"] == "critical"
    assert "rank 0" in f["evidence"] and "rank 1" in f["evidence"] and "prefill ranks 2, 3 idle" in f["evidence"]
    assert "follow_bootstrap_room" in f["fix"]


@pytest.mark.timeout(60)
def test_a_busy_prefill_is_not_a_rendezvous_failure(board_name):
    decode = ["--pd", "decode", "--transfer-growth", "40"]
    with writers(board_name, 2, {0: decode, 1: ["--pd", "prefill", "--running", "3"]}):
        _, report = doctor_json(board_name, 1.0)
    assert "pd_rendezvous" not in by_id(report)


@pytest.mark.timeout(60)
def test_received_counts_one_sided_while_loads_are_even(board_name):
    """No dispatch record: the board's own num_received_reqs tell the dispatch share."""
    with writers(board_name, 2, {0: ["--recv-rate", "400"], 1: ["--recv-rate", "20"]}):
        status, report = doctor_json(board_name, 1.5)
    assert status == 1
    f = by_id(report)["dispatch_vs_load"]
    assert f["title"] == "dispatch one-sided while the loads are even"
    assert "rank 0 9" in f["evidence"]  # a share of 90-odd percent


@pytest.mark.timeout(60)
def test_small_loads_on_a_balanced_deployment_are_not_one_sided(board_name):
    """A real `vllm serve` with 100 requests split 47/53: mean total tokens 0 and 293 against about 1M
    capacity each is a max/mean of 2, and was reported as "dispatch even while the loads are
    one-sided" (exit 1). A gap of 293 tokens in 1M is no imbalance: healthy, exit 0."""
    with writers(board_name, 2, {
        0: ["--total", "0", "--used", "0", "--cap", "1048576", "--running", "0", "--recv-rate", "47"],
        1: ["--total", "293", "--used", "293", "--cap", "1048576", "--running", "1", "--recv-rate", "53"],
    }):
        status, report = doctor_json(board_name, 1.5)
    assert "dispatch_vs_load" not in by_id(report), report["findings"]
    assert status == 0 and report["healthy"], report["findings"]


@pytest.mark.timeout(60)
def test_loads_one_sided_above_the_floor_are_still_found(board_name):
    """The same even dispatch with a gap of a fifth of the KV capacity: the finding stays."""
    with writers(board_name, 2, {
        0: ["--total", "0", "--used", "0", "--cap", "1048576", "--running", "0", "--recv-rate", "47"],
        1: ["--total", "200000", "--used", "200000", "--cap", "1048576", "--running", "9", "--recv-rate", "53"],
    }):
        status, report = doctor_json(board_name, 1.5)
    assert status == 1
    f = by_id(report)["dispatch_vs_load"]
    assert f["title"] == "dispatch even while the loads are one-sided" and "rank 1 200000" in f["evidence"]


@pytest.mark.timeout(60)
def test_text_report_gives_evidence_cause_and_fix(board_name):
    with writers(board_name, 1, {0: []}):
        res = doctor(board_name, "--window", "0.5")
    assert res.returncode == 1, res.stderr
    out = res.stdout
    assert f"board {board_name}, 1 slots" in out
    assert "[warning] one slot: dp_size is 1" in out
    for label in ("evidence:", "cause:", "fix:"):
        assert label in out


def test_a_missing_board_is_one_line_and_status_2(board_name):
    res = doctor(board_name, "--window", "0.2")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and board_name in res.stderr


# -- a real controller ------------------------------------------------------------------------------


@contextlib.contextmanager
def controller(name: str, tmp_path: Path, n: int, *args: str) -> Iterator[tuple[zmq.Socket, subprocess.Popen]]:
    """``n`` fake schedulers publishing to board ``name`` and a controller over them; yields the
    PUSH that feeds the controller, and the controller."""
    procs: list[subprocess.Popen] = []
    ctx = zmq.Context()
    eps = [f"ipc://{tmp_path}/w{r}" for r in range(n)]
    in_ep = f"ipc://{tmp_path}/in"
    with Board.create(name, n_slots=n) as board:
        try:
            for r in range(n):
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.fake_scheduler", name, str(r),
                                               eps[r], str(tmp_path / f"out-{r}.json")], cwd=ROOT,
                                              stdout=subprocess.DEVNULL))
            reader = board.reader()
            wait_for(lambda: all(s is not None for s in reader.read_all()), 20, "the schedulers' first publish")
            ctl = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "controller", "--input", in_ep,
                                    "--workers", *eps, "--board", name, "--log-every", "60", *args], cwd=ROOT,
                                   stderr=subprocess.PIPE, text=True)
            procs.append(ctl)
            wait_for(lambda: Path(dispatch_record_path(name)).exists() or ctl.poll() is not None, 60,
                     "the controller's dispatch record")
            assert ctl.poll() is None, ctl.stderr.read()
            _wait_serving(name, ctl)
            yield connected_push(ctx, in_ep), ctl
            if ctl.poll() is None:  # one a test killed on purpose is not asked for a clean exit
                stop(ctl)
                assert ctl.returncode == 0, ctl.stderr.read()
        finally:
            for p in procs:
                stop(p)
            ctx.destroy(linger=0)


def _wait_serving(name: str, ctl: subprocess.Popen) -> None:
    """Until the controller's loop runs (its SIGTERM handler in place): its row is claimed before the
    loop starts, and published again by the loop's first turn. A record it could not use (a test's
    planted file) gives no row: then the loop's start is not seen here."""

    def row() -> object:
        try:
            return next((r for r in read_dispatch_record(name) or [] if r.pid == ctl.pid), None)
        except DpboardError:
            return None

    first = row()
    if first is None:
        return
    wait_for(lambda: ctl.poll() is not None or (r := row()) is None or r.wall_ns != first.wall_ns, 20,
             "the controller's first turn of its loop")


def feed_during(push: zmq.Socket, frame: Callable[[int], bytes], args: list[str], gap: float = 0.004,
                before: int = 0) -> tuple[int, dict]:
    """Run ``dpboard doctor`` while sending ``frame(i)`` every ``gap`` seconds; its status and report."""
    for i in range(before):
        push.send(frame(i))
    proc = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "doctor", *args, "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        i = before
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            push.send(frame(i))
            i += 1
            time.sleep(gap)
        out, err = proc.communicate(timeout=30)
    finally:
        kill(proc)
    assert proc.returncode in (0, 1), err
    return proc.returncode, json.loads(out)


@pytest.mark.timeout(90)
def test_requests_pinned_by_routed_dp_rank(board_name, tmp_path):
    with controller(board_name, tmp_path, 3, "--method", "round_robin") as (push, _):
        frame = lambda i: encode_request(f"r{i}", num_tokens=10, routed_dp_rank=1 if i % 10 else None)  # noqa: E731
        status, report = feed_during(push, frame, [board_name, "--window", "1.5"])
    assert status == 1
    f = by_id(report)["routed_one_rank"]
    assert f["severity"] == "critical" and "routed to rank 1 by routed_dp_rank" in f["title"]
    (d,) = report["dispatchers"]
    assert d["method"] == "round_robin" and d["alive"]
    assert 0.85 <= report["routed_share"] <= 0.95


@pytest.mark.timeout(90)
@pytest.mark.parametrize("interval", ["0", "0.02"])
def test_refreshes_without_a_throttle(board_name, tmp_path, interval):
    with controller(board_name, tmp_path, 2, "--method", "total_tokens", "--refresh-interval", interval) as (push, _):
        frame = lambda i: encode_request(f"r{i}", num_tokens=5)  # noqa: E731
        _, report = feed_during(push, frame, [board_name, "--window", "1.5"], gap=0.002)
    (d,) = report["dispatchers"]
    assert d["method"] == "total_tokens" and d["refresh_interval_s"] == float(interval)
    found = by_id(report)
    if interval == "0":
        assert d["refreshes_per_s"] > 50, d
        f = found["refresh_rate"]
        assert "no throttle" in f["title"] and "--refresh-interval 0.02" in f["fix"]
    else:
        assert d["refreshes_per_s"] <= 1.25 * 50 + 1, d
        assert "refresh_rate" not in found


def long_and_short(i: int) -> bytes:
    """Prompts of 2000 and 10 tokens alternating: over two ranks taken in turn, every long one lands
    on rank 0."""
    return encode_request(f"r{i}", num_tokens=2000 if i % 2 == 0 else 10)


def doctor_on_long_and_short(name: str, tmp_path: Path, method: str) -> tuple[int, dict]:
    """``dpboard doctor`` over 1.5 s of ``long_and_short`` prompts sent to a controller of two ranks."""
    with controller(name, tmp_path, 2, "--method", method) as (push, _):
        return feed_during(push, long_and_short, [name, "--window", "1.5"], gap=0.01, before=20)


@pytest.mark.timeout(90)
def test_round_robin_under_skewed_load(board_name, tmp_path):
    """Long and short prompts alternate over two ranks: round robin gives rank 0 every long one."""
    status, report = doctor_on_long_and_short(board_name, tmp_path, "round_robin")
    assert status == 1
    f = by_id(report)["load_unaware_skew"]
    assert f["title"] == "load-unaware round_robin under skewed load" and "total_tokens" in f["fix"]


@pytest.mark.timeout(90)
def test_requests_spread_evenly_while_the_tokens_pile_up(board_name, tmp_path):
    """total_requests counts requests, not tokens: long and short prompts alternating over two ranks
    go out one for one, and every long one lands on rank 0."""
    status, report = doctor_on_long_and_short(board_name, tmp_path, "total_requests")
    assert status == 1
    f = by_id(report)["dispatch_vs_load"]
    assert f["title"] == "dispatch even while the loads are one-sided" and "token-aware" in f["fix"]
    assert "load_unaware_skew" not in by_id(report)  # total_requests reads the loads: not that finding


@pytest.mark.timeout(90)
def test_uneven_bootstrap_rooms_and_requests_without_a_room(board_name, tmp_path):
    with controller(board_name, tmp_path, 2, "--method", "follow_bootstrap_room",
                    "--disaggregation-mode", "prefill") as (push, _):
        # even rooms only: room % 2 is always 0; every 25th request has no room at all
        frame = lambda i: encode_request(f"r{i}", num_tokens=5, bootstrap_room=None if i % 25 == 0 else 2 * i)  # noqa: E731
        status, report = feed_during(push, frame, [board_name, "--window", "1.5"])
    assert status == 1
    found = by_id(report)
    assert "rank 0" in found["rooms_uneven"]["evidence"] and "rank 1 0" in found["rooms_uneven"]["evidence"]
    assert "bootstrap_room" in found["rejected"]["cause"] and "router" in found["rejected"]["fix"]
    assert report["room_share"] == 1.0  # every dispatched request carried one; the others were rejected
    assert "prefill_round_robin" not in found


@pytest.mark.timeout(90)
def test_round_robin_asked_of_a_pd_prefill_is_reported_as_the_room_method_it_runs(board_name, tmp_path):
    """dpboard's controller turns round_robin on a prefill server into follow_bootstrap_room (as
    SGLang does): its record says which method is in effect, and the doctor finds no fault."""
    with controller(board_name, tmp_path, 2, "--method", "round_robin", "--disaggregation-mode", "prefill") as (push, _):
        frame = lambda i: encode_request(f"r{i}", num_tokens=5, bootstrap_room=i)  # noqa: E731
        status, report = feed_during(push, frame, [board_name, "--window", "1.0"])
    (d,) = report["dispatchers"]
    assert (d["method"], d["mode"]) == ("follow_bootstrap_room", "prefill")
    assert status == 0, report["findings"]
    assert report["room_share"] == 1.0


@pytest.mark.timeout(90)
def test_a_killed_controller_leaves_a_silent_record_until_its_board_goes(board_name, tmp_path):
    with controller(board_name, tmp_path, 2, "--method", "round_robin") as (push, ctl):
        push.send(encode_request("r0", num_tokens=5))
        ctl.send_signal(signal.SIGKILL)  # no chance to remove its record
        ctl.wait(10)
        status, report = doctor_json(board_name, 0.3)
        assert Path(dispatch_record_path(board_name)).exists()
    # the board's unlink took the record whose every writer is gone (the autouse check sees no leak)
    # the lock files the killed controller could not remove go as `dpboard clean` would take them
    for lock in LOCK_DIR.glob(f"{LOCK_PREFIX}*.lock"):
        if board_name in lock.name or tmp_path.name in lock.name:
            lock.unlink(missing_ok=True)
    assert status == 1
    f = by_id(report)["record_silent"]
    assert f"pid {ctl.pid} (gone" in f["evidence"]


@pytest.mark.timeout(90)
def test_a_clean_controller_exit_removes_its_record(board_name, tmp_path):
    with controller(board_name, tmp_path, 2, "--method", "round_robin"):
        assert Path(dispatch_record_path(board_name)).exists()
    assert not Path(dispatch_record_path(board_name)).exists()


# -- top's header and serve's /v1/doctor -------------------------------------------------------------


def _one_live_of_three(name: str) -> Iterator[list[subprocess.Popen]]:
    return writers(name, 3, {0: [], 1: ["--once"], 2: ["--once"]})


@pytest.mark.timeout(60)
def test_tops_header_names_the_worst_finding(board_name):
    with _one_live_of_three(board_name):
        time.sleep(1.2)  # ranks 1 and 2 past the stale threshold
        text = subprocess.run([sys.executable, "-m", "dpboard.cli", "top", board_name, "--once"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        js = subprocess.run([sys.executable, "-m", "dpboard.cli", "top", board_name, "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    (line,) = [ln for ln in text.stdout.splitlines() if ln.startswith("doctor:")]
    assert line.startswith("doctor: 2 findings — worst: [critical] only 1 of 3 ranks live (rank 0)"), line
    doc = json.loads(js.stdout)["doctor"]
    assert not doc["healthy"] and {f["id"] for f in doc["findings"]} >= {"one_live_rank", "stale_or_torn"}


@pytest.mark.timeout(60)
def test_tops_header_says_healthy_when_it_is(board_name):
    with writers(board_name, 2, {0: [], 1: []}):
        text = subprocess.run([sys.executable, "-m", "dpboard.cli", "top", board_name, "--once"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    # one look (two reads 0.2 s apart) is no window to call healthy: it says what it saw
    (line,) = [ln for ln in text.stdout.splitlines() if ln.startswith("doctor:")]
    assert re.fullmatch(r"doctor: nothing found in a 0\.\d s look \(dpboard doctor watches 30 s\)", line), line


@pytest.mark.timeout(60)
def test_serve_answers_v1_doctor_with_the_findings(board_name):
    from tests.support.serving import get, start_server

    with _one_live_of_three(board_name):
        time.sleep(1.2)
        proc, url = start_server(board_name)
        try:
            status, ctype, body = get(url + "/v1/doctor")
            time.sleep(0.6)
            status2, _, body2 = get(url + "/v1/doctor")  # a later sample: the window grows
            bad, _, why = get(url + "/v1/doctor?x=1")
            missing, _, listing = get(url + "/nowhere")
        finally:
            stop(proc)
    assert (status, status2, bad, missing) == (200, 200, 400, 404) and ctype == "application/json"
    doc, later = json.loads(body), json.loads(body2)
    assert set(doc) == {"healthy", "window_s", "findings"} and doc["healthy"] is False
    assert later["window_s"] > doc["window_s"] == 0.0
    for f in doc["findings"]:
        assert set(f) == FINDING_KEYS and f["severity"] in ("critical", "warning", "info")
    assert doc["findings"][0]["title"] == "only 1 of 3 ranks live (rank 0)"
    assert "takes no query parameters" in json.loads(why)["error"] and "/v1/doctor" in json.loads(listing)["error"]


def test_without_a_name_several_boards_are_named_for_the_user_to_choose(board_name):
    from tests.support.names import new_board_name

    other = new_board_name()
    with Board.create(board_name, 1), Board.create(other, 1):
        res = doctor("--window", "0.2")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "name the one to check" in res.stderr and board_name in res.stderr and other in res.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_window_shows_its_progress_in_a_terminal(board_name):
    """A 30 s window with nothing on screen looks hung: at 80 columns a count of the seconds and
    samples so far is rewritten in place, and gone when the report comes."""
    socket = f"dpboard-doctor-{os.getpid()}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    command = (f"{sys.executable} -m dpboard.cli doctor {board_name} --window 6 --samples 3; "
               f"echo DOCTOR-EXITED-$?; sleep 30")
    with writers(board_name, 2, {0: [], 1: []}):
        subprocess.run([*tmux, "new-session", "-d", "-s", "doctor", "-x", "80", "-y", "30", command],
                       check=True, timeout=30, env={**os.environ, "TERM": "xterm-256color"}, cwd=ROOT)
        try:
            counts, screen = set(), ""
            deadline = time.monotonic() + 90
            while "DOCTOR-EXITED-" not in screen and time.monotonic() < deadline:
                screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "doctor"], capture_output=True,
                                        text=True, timeout=30).stdout
                counts.update(re.findall(rf"watching board {board_name}: (\d+) of 6 s, \d of 3 samples", screen))
                time.sleep(0.2)
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)
    assert "DOCTOR-EXITED-0" in screen, screen
    assert len(counts) >= 2, (counts, screen)  # a live count, not one line
    assert "watching board" not in screen and f"dpboard doctor: board {board_name}, 2 slots" in screen, screen


def test_the_window_is_said_in_one_line_without_a_terminal(board_name):
    with writers(board_name, 2, {0: [], 1: []}):
        res = doctor(board_name, "--window", "0.5", "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr == f"dpboard doctor: watching board {board_name} for 0.5 s (7 samples) ...\n"
    assert json.loads(res.stdout)["healthy"] is True
