"""`dpboard demo` end to end (real processes, board, ZMQ controller), and its scheduler model."""

from __future__ import annotations

import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dpboard.demo.scheduler import SchedulerModel
from dpboard.loads import PageState, ReqState, compute_loads
from tests.support.mixed_board import PYTHON
from tests.support.names import new_board_name
from tests.support.procutil import kill, read_line

pytestmark = pytest.mark.timeout(180)


def processes_mentioning(text: str) -> list[int]:
    """Pids of processes whose command line contains ``text`` (the board name every child is given)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def check_summary(out: str, ranks: int) -> dict[str, float]:
    sent = int(re.search(r"requests sent (\d+)", out).group(1))
    served = int(re.search(r"served (\d+)", out).group(1))
    p50, p99 = (float(x) for x in re.search(r"queueing delay.*p50 ([\d.]+) ms, p99 ([\d.]+) ms", out).groups())
    per_rank = re.search(r"served per rank: +(.*)", out).group(1).split()
    assert [int(item.split(":")[0]) for item in per_rank] == list(range(ranks))
    assert sum(int(item.split(":")[1]) for item in per_rank) == served
    assert 0 < served <= sent
    assert 0 <= p50 <= p99
    assert re.search(r"imbalance \(max/mean total tokens over live ranks\): mean [\d.]+, worst [\d.]+", out)
    return {"sent": sent, "served": served}


def test_demo_runs_and_cleans_up():
    name = new_board_name()
    proc = subprocess.run(
        [PYTHON, "-m", "dpboard.cli", "demo", "--duration", "5", "--ranks", "4", "--board", name,
         "--print-every", "1"],
        capture_output=True, text=True, timeout=150,
    )
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout
        assert "\x1b[" not in out  # no terminal: plain frames
        assert out.count(f"board {name}") >= 3  # a frame every second or so
        assert "4 live" in out
        summary = check_summary(out, 4)
        received = int(re.search(r"received by schedulers (\d+)", out).group(1))
        assert received == summary["sent"]  # every request the controller got reached a scheduler
        assert "Traceback" not in proc.stderr
        assert not Path(f"/dev/shm/dpboard.{name}").exists()
        assert processes_mentioning(name) == []
    finally:
        for pid in processes_mentioning(name):  # never leave a child behind, even when failing
            subprocess.run(["kill", "-9", str(pid)], check=False)


@pytest.mark.parametrize(("sig", "how"), [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"),
                                         (signal.SIGHUP, "SIGHUP")])
def test_a_stop_signal_stops_everything_and_prints_the_summary(sig, how):
    import os
    import shutil

    name = new_board_name()
    # a temporary folder of this demo's own (short: its sockets' paths must fit), so that another
    # demo running meanwhile (another test, another run) is never taken for one left behind
    tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")
    proc = subprocess.Popen(
        [PYTHON, "-m", "dpboard.cli", "demo", "--duration", "120", "--ranks", "2", "--board", name,
         "--print-every", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": tmp},
    )
    try:
        deadline = time.monotonic() + 120
        while "2 live" not in read_line(proc, max(1.0, deadline - time.monotonic())):
            pass
        time.sleep(1.5)  # some requests get served
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"stopped by {how}" in err
        check_summary(out, 2)
        assert not Path(f"/dev/shm/dpboard.{name}").exists()
        assert processes_mentioning(name) == []  # the schedulers and the controller are gone
        assert list(Path(tmp).glob("dpboard-demo-*")) == []  # its work folder went with it
    finally:
        kill(proc)
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize(("args", "words"), [
    (["--ranks", "0"], "argument --ranks: 0 is outside [1, 256]"),
    (["--method", "fastest"], "fastest"),
    (["--duration", "-1"], "argument --duration: -1 is outside (0, 1e+06] seconds"),
    (["--rate", "inf"], "argument --rate: 'inf' is not a finite number"),
    (["--num-pages", "10"], "raise --num-pages"),
])
def test_bad_arguments_fail_before_starting_anything(args, words):
    name = new_board_name()
    proc = subprocess.run([PYTHON, "-m", "dpboard.cli", "demo", "--board", name, *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert not Path(f"/dev/shm/dpboard.{name}").exists()


def loads_of(model: SchedulerModel):
    return compute_loads(model.req_state, model.req_seqlen, model.page_state, page_size=model.page_size,
                         backend="numpy")


def test_scheduler_model_prefill_decode_finish():
    model = SchedulerModel(num_pages=64, page_size=4, max_reqs=8, max_running=4, prefix_share=1.0)
    model.receive({"rid": "a", "num_tokens": 6, "output_len": 3}, now=0.0)
    model.receive({"rid": "b", "num_tokens": 4, "output_len": 1}, now=0.0)
    waiting = loads_of(model)
    assert (waiting.num_waiting_reqs, waiting.num_used_tokens, waiting.num_total_tokens) == (2, 0, 10)
    assert model.step(now=0.5) == [  # b: 4 prompt tokens + 1 decoded = done in its first step
        {"rid": "b", "prompt": 4, "output": 1, "queue_s": 0.5, "latency_s": None}]
    after = loads_of(model)
    assert after.num_running_reqs == 1 and after.num_waiting_reqs == 0
    # a holds ceil(7 / 4) = 2 pages; b's one whole prompt page stayed as an evictable prefix.
    assert after.num_used_tokens == 2 * 4
    assert int((model.page_state == PageState.EVICTABLE).sum()) == 1
    model.step(now=0.6)
    done = model.step(now=0.7)
    assert [d["rid"] for d in done] == ["a"] and done[0]["queue_s"] == 0.5
    assert loads_of(model).num_used_tokens == 0 and model.num_received == 2
    assert (model.req_state == ReqState.FREE).all()


def test_scheduler_model_retracts_when_out_of_pages():
    model = SchedulerModel(num_pages=4, page_size=4, max_reqs=4, max_running=4, prefix_share=0.0)
    model.receive({"rid": "a", "num_tokens": 4, "output_len": 40}, now=0.0)
    model.receive({"rid": "b", "num_tokens": 3, "output_len": 40}, now=0.0)
    for k in range(12):
        model.step(now=float(k))
        loads = loads_of(model)
        assert loads.num_used_tokens <= loads.max_total_num_tokens
        held = sum(len(p) for p in model.pages_of)
        assert held == int((model.page_state == PageState.USED).sum())
    assert model.num_retracted >= 1
    assert np.isin(model.req_state, [ReqState.RUNNING, ReqState.RETRACTED, ReqState.FREE]).all()


def test_follow_bootstrap_room_demo_sends_rooms_and_serves():
    """follow_bootstrap_room refuses a request without a room: the demo gives each request one."""
    name = new_board_name()
    proc = subprocess.run(
        [PYTHON, "-m", "dpboard.cli", "demo", "--duration", "3", "--ranks", "2", "--board", name,
         "--method", "follow_bootstrap_room", "--print-every", "10"],
        capture_output=True, text=True, timeout=150,
    )
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = check_summary(proc.stdout, 2)
        received = int(re.search(r"received by schedulers (\d+)", proc.stdout).group(1))
        assert received == summary["sent"] > 0
        assert "never reached a scheduler" not in proc.stdout and "NO request" not in proc.stdout
    finally:
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_the_summary_says_when_requests_did_not_reach_a_scheduler():
    from dpboard.demo.run import RunStats

    stats = RunStats(ranks=2, sent=40)
    assert "NO request reached a scheduler" in stats.summary("follow_bootstrap_room")
    stats.received_by_rank = [15, 20]
    assert "5 of the requests sent never reached a scheduler" in stats.summary("total_tokens")
    stats.received_by_rank = [20, 20]
    assert "never reached" not in stats.summary("total_tokens")


def test_demo_method_lists_its_choices():
    proc = subprocess.run([PYTHON, "-m", "dpboard.cli", "demo", "--method", "bogus"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "follow_bootstrap_room" in proc.stderr and "inflight_backlog" in proc.stderr


def test_a_child_killed_past_its_stop_timeout_leaves_nothing_in_dev_shm():
    """The controller stopped (SIGSTOP) cannot act on the demo's SIGTERM: the demo kills it with
    SIGKILL after its stop timeout, as it does a child too slow under load. What that child held in
    /dev/shm (its lock files, the board's dispatch record) goes with the board all the same."""
    import os
    import shutil

    name = new_board_name()
    # a temporary folder of this demo's own: another test's demo running meanwhile is not this one's
    tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")
    proc = subprocess.Popen([PYTHON, "-m", "dpboard.cli", "demo", "--duration", "4", "--ranks", "2", "--board",
                             name, "--print-every", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": tmp})
    try:
        deadline = time.monotonic() + 120
        while "2 live" not in read_line(proc, max(1.0, deadline - time.monotonic())):
            pass
        (workdir,) = Path(tmp).glob("dpboard-demo-*")
        mine = lambda: sorted(n for n in os.listdir("/dev/shm") if name in n or workdir.name in n)  # noqa: E731
        assert len(mine()) >= 4, mine()  # the board, its dispatch record, the controller's two lock files
        (controller,) = [pid for pid in processes_mentioning(name)
                         if b"controller" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(controller, signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert processes_mentioning(name) == []
        assert mine() == []
    finally:
        kill(proc)
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_first_run_says_that_numba_compiles_and_the_last_lines_how_to_reach_dpboard(tmp_path):
    """An empty Numba cache is a first run: the demo says that it compiles while it does, before the
    board is shown; the venv's bin folder is not on PATH (as after `make demo`): its last lines say
    how to get the dpboard command."""
    import os
    import sys

    name = new_board_name()
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "PATH": path}
    proc = subprocess.run([PYTHON, "-m", "dpboard.cli", "demo", "--duration", "1", "--ranks", "1", "--board", name],
                          capture_output=True, text=True, timeout=170, env=env)
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        compiling = next(i for i, line in enumerate(lines) if line.startswith("dpboard demo: Numba is compiling"))
        compiled = next(i for i, line in enumerate(lines) if re.fullmatch(r"dpboard demo: kernels compiled in \d+ s", line))
        first_frame = next(i for i, line in enumerate(lines) if line.startswith("dpboard top"))
        assert compiling < compiled < first_frame
        named = re.fullmatch(r"dpboard demo: the dpboard command is (\S+), not on PATH:", lines[-2])
        assert named and Path(named.group(1)).resolve() == (Path(venv_bin) / "dpboard").resolve(), lines[-2:]
        assert re.fullmatch(r"  `\. \S+/activate` puts it there \(or run \S+/dpboard itself\)", lines[-1]), lines[-1]
    finally:
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)


def test_no_path_hint_when_dpboard_is_on_path(monkeypatch):
    import os
    import sys

    from dpboard.demo.run import path_hint

    venv_bin = str(Path(sys.executable).parent)
    others = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    monkeypatch.setenv("PATH", os.pathsep.join([venv_bin, *others]))
    assert path_hint() is None
    monkeypatch.setenv("PATH", os.pathsep.join(others))
    assert "not on PATH" in path_hint()


def test_the_summary_fits_a_terminal_and_breaks_between_figures():
    from dpboard.demo.run import RunStats

    stats = RunStats(ranks=16, sent=2089, queue_s=[0.0103, 0.2857], latency_s=[1.9229, 3.8062], imbalance=[1.17, 1.52])
    stats.served_by_rank = [200 + r for r in range(16)]
    stats.received_by_rank = [2300 + r for r in range(16)]
    wide = stats.summary("total_tokens")
    for width in (60, 80, 100):
        text = stats.summary("total_tokens", width)
        assert all(len(line) <= width for line in text.splitlines()), text
        # the same words, only the breaks differ: no figure is split from its label or unit
        assert text.split() == wide.split()
        figures = re.findall(r"p\d+ [\d.]+ ms|(?:mean|worst) [\d.]+|over \d+ samples|\d+:\d+", wide)
        assert len(figures) == 4 + 2 + 1 + 2 * 16
        for figure in figures:
            assert re.search(rf"(^|\s){re.escape(figure)}(\s|,|$)", text), (figure, text)
