"""The step log: what the writer writes is what the reader and ``dpboard steps`` read back, with its
counts (the size cap, a full ring, unmatched steps, faults), from files written by real processes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from dpboard.errors import InvalidInputError
from dpboard.steplog import format as fmt
from dpboard.steplog import writer as writer_module
from dpboard.steplog.reader import read_step_log, step_log_paths, step_times
from dpboard.steplog.settings import ENV_MAX_MIB, ENV_STEP_LOG, step_log_settings
from dpboard.steplog.summary import batch_bucket, render, summarize
from dpboard.steplog.writer import MAX_FAULTS, StepLog
from tests.support.names import ROOT
from tests.support.other_user import as_nobody
from tests.support.procutil import kill, read_line

pytestmark = pytest.mark.timeout(120)
HEADER = {"engine_version": "0.0-test", "settings": {"chunked_prefill_size": 8192, "max_running_requests": 256,
                                                     "max_total_tokens": 100_000, "overlap": True,
                                                     "dp_attention": False, "method": "total_tokens"}}


def dpboard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def new_log(tmp_path, **kwargs) -> StepLog:
    kwargs.setdefault("max_bytes", 1 << 20)
    return StepLog(tmp_path, engine="test", rank=kwargs.pop("rank", 0), header=HEADER, at_exit=False, **kwargs)


def extend(log: StepLog, step: int, t0: int, tokens: int, duration: int = 1000, **kw) -> None:
    log.record(t0, duration, step, kw.get("prefix", 0), 0, tokens, kw.get("reqs", 1), 0, 0, kw.get("reqs", 1),
               fmt.EXTEND)


def decode(log: StepLog, step: int, t0: int, reqs: int, ctx: int, duration: int = 1000) -> None:
    log.record(t0, duration, step, 0, ctx, 0, 0, reqs, reqs, reqs, fmt.DECODE)


# version 1's record, written out here rather than derived: what an earlier dpboard wrote
V1_RECORD = struct.Struct("<qqqqqiiiiiBBBx")


def write_log_by_hand(path, version: int, record_size: int, rows: list[tuple], pack=V1_RECORD.pack) -> None:
    """A closed step log of ``version`` holding ``rows`` (each packed by ``pack``), as its writer would."""
    header = fmt.pad_header(json.dumps({"format": fmt.FORMAT_NAME, "version": version, "engine": "sglang", "rank": 0,
                                        "pid": 1, "settings": HEADER["settings"]}))
    prelude = fmt.PRELUDE.pack(fmt.MAGIC, version, record_size, len(header), fmt.CLOSED, len(rows), 0, 0, 0, 0, 0,
                               0, 0)
    path.write_bytes(prelude + header + b"".join(pack(*row) for row in rows))


# -- the format ---------------------------------------------------------------------------------------------


def test_a_record_is_72_bytes_and_the_numpy_dtype_reads_the_same_bytes():
    values = (123456789012, 2_000_000, 1_500_000, 7, 4096, 70_000, 512, 3, 60, 61, 63, fmt.MIXED,
              fmt.GROUP_EXTEND, 3)
    raw = fmt.RECORD.pack(*values)
    assert len(raw) == fmt.RECORD_SIZE == 72 and fmt.PRELUDE.size == 128 and fmt.VERSION == 2
    row = np.frombuffer(raw, dtype=fmt.record_dtype())[0]
    assert tuple(row[name] for name, _, _ in fmt.RECORD_FIELDS) == values
    assert fmt.record_offsets()["launch_ns"] == 16  # among the int64s: each stays 8-byte aligned


def test_version_1_records_are_the_same_fields_without_launch_ns_in_64_bytes():
    assert fmt.RECORD_SIZES == {1: 64, 2: 72}
    assert [name for name, _, _ in fmt.record_fields(1)] == [name for name, _, _ in fmt.RECORD_FIELDS
                                                             if name != "launch_ns"]
    assert fmt.record_struct(1).format == V1_RECORD.format and fmt.record_dtype(1).itemsize == 64


def test_the_header_line_is_json_padded_to_64_bytes():
    line = fmt.pad_header(json.dumps({"a": 1}))
    assert len(line) % 64 == 0 and line.endswith(b"\n") and json.loads(line) == {"a": 1}


@pytest.mark.parametrize(("size", "bucket"), [(0, (0, 0)), (1, (1, 1)), (2, (2, 3)), (3, (2, 3)), (4, (4, 7)),
                                              (255, (128, 255)), (256, (256, 511))])
def test_batch_buckets_are_powers_of_two(size, bucket):
    assert batch_bucket(size) == bucket


# -- the writer, back through the reader -------------------------------------------------------------------


def test_steps_written_are_read_back_whole_with_header_and_final_counts(tmp_path):
    log = new_log(tmp_path, rank=3)
    t = time.monotonic_ns()
    extend(log, 0, t, 100, prefix=28)
    log.begin(1, t + 2000, 0, 300, 0, 0, 3, 3, 3, fmt.DECODE)
    log.end(1, t + 2500)
    decode(log, 2, t + 3000, 4, 400)
    log.close()
    assert log.path.name == f"steps-test-{os.getpid()}-rank3.bin"
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
    f = read_step_log(log.path)
    assert f.closed and f.partial_bytes == 0
    assert f.header["format"] == "dpboard-steplog" and f.header["rank"] == 3 and f.header["pid"] == os.getpid()
    assert f.settings == HEADER["settings"]
    assert f.counts["written"] == 3 and not any(f.counts[k] for k in ("dropped_cap", "dropped_ring", "faults",
                                                                         "unmatched", "dropped_io"))
    r = f.records
    assert list(r["step"]) == [0, 1, 2] and list(r["mode"]) == [fmt.EXTEND, fmt.DECODE, fmt.DECODE]
    assert (r["prefill_tokens"][0], r["prefix_tokens"][0]) == (100, 28)
    assert (r["decode_reqs"][1], r["decode_ctx_tokens"][1], r["duration_ns"][1]) == (3, 300, 500)
    assert r["t_start_ns"][1] == t + 2000


def test_a_step_whose_next_began_before_it_ended_is_flagged_overlapped(tmp_path):
    log = new_log(tmp_path)
    t = 1_000_000
    log.begin(0, t, 0, 0, 50, 1, 0, 0, 1, fmt.EXTEND)
    log.begin(1, t + 100, 0, 51, 0, 0, 1, 1, 1, fmt.DECODE)  # launched before 0's result was processed
    log.end(0, t + 1000)
    log.end(1, t + 2000)
    log.close()
    r = read_step_log(log.path).records
    assert list(r["flags"]) == [fmt.OVERLAPPED, 0]
    assert list(r["duration_ns"]) == [1000, 1900]
    assert list(step_times(r)) == [1000, 1000]  # step 1's time starts where step 0's ended


def test_a_version_1_log_is_read_with_launch_ns_0_and_the_same_step_times(tmp_path):
    # (t_start, duration, step, prefix, ctx, prefill, prefill_reqs, decode_reqs, decode_tokens, batch, mode,
    # flags, raw): an extend overlapped by a decode, which then runs alone, then a decode after a gap
    rows = [(10_000, 5_000, 1, 32, 0, 100, 1, 0, 0, 1, fmt.EXTEND, fmt.OVERLAPPED, 1),
            (12_000, 6_000, 2, 0, 101, 0, 0, 1, 1, 1, fmt.DECODE, 0, 2),
            (20_000, 1_000, 3, 0, 102, 0, 0, 1, 1, 1, fmt.DECODE, 0, 2)]
    path = tmp_path / "steps-sglang-1-rank0.bin"
    write_log_by_hand(path, 1, 64, rows)
    f = read_step_log(path)
    assert f.closed and f.partial_bytes == 0 and f.counts["written"] == 3
    assert f.records.dtype == fmt.record_dtype()
    names = [name for name, _, _ in fmt.record_fields(1)]
    assert [tuple(int(r[name]) for name in names) for r in f.records] == rows
    assert list(f.records["launch_ns"]) == [0, 0, 0]
    # version 1's rule, by hand: from the later of a step's start and the previous step's end, to its end
    assert list(step_times(f.records)) == [5_000, 18_000 - 15_000, 1_000]
    new = new_log(tmp_path)  # a version 2 log beside it: the summary takes both
    extend(new, 0, 0, 50)
    new.close()
    summary = summarize([f, read_step_log(new.path)])
    assert summary["steps"] == 4 and summary["modes"]["extend"]["steps"] == 2


def test_each_step_gets_its_own_forward_where_launching_is_the_forward(tmp_path):
    """A CPU under SGLang's overlap scheduler: ``run_batch`` returns after the forward, and the next batch
    is scheduled and launched before a result is processed, so each step's window holds the next one's
    forward. The windows, and what each step computed, from the timeline built here."""
    forward, schedule, process = [5_000_000, 3_000_000, 2_000_000], 100_000, 200_000
    log = new_log(tmp_path)
    t = 0
    start, end = [], []
    for step in range(3):
        start.append(t)
        t += forward[step]  # run_batch: the whole forward, before it returns
        log.begin(step, start[step], 0, 0, 10, 1, 0, 0, 1, fmt.EXTEND, launch_ns=forward[step])
        if step:
            t += process  # the previous step's result
            end.append(t)
            log.end(step - 1, t)
        t += schedule  # the next batch (after the last one: the loop's try, which finds none)
    t += process  # the last result
    end.append(t)
    log.end(2, t)
    log.close()
    r = read_step_log(log.path).records
    assert list(r["launch_ns"]) == forward and list(r["t_start_ns"]) == start
    assert list(r["flags"]) == [fmt.OVERLAPPED, fmt.OVERLAPPED, 0]
    windows = [end[0] - start[0], end[1] - end[0], end[2] - end[1]]  # version 1's rule
    no_launch = r.copy()
    no_launch["launch_ns"] = 0
    assert list(step_times(no_launch)) == windows
    assert windows[1] == forward[2] + process + schedule  # the next step's forward, not its own
    # what each step's own turn of the loop spent: its forward, one scheduling, one result processed
    own = [forward[step] + schedule + process for step in range(3)]
    times = step_times(r)
    assert list(times) == own and times.sum() == sum(windows)


def test_a_launch_moves_only_from_an_overlapped_step_and_only_what_lies_in_its_window():
    r = np.zeros(4, dtype=fmt.record_dtype())
    # step 0 overlapped by step 1, whose launch runs past step 0's end; step 2 not flagged, though step 3
    # launched inside its duration (a log whose flag says otherwise: the flag rules)
    r["t_start_ns"] = [0, 800, 2000, 2500]
    r["duration_ns"] = [1000, 1200, 1000, 1000]
    r["launch_ns"] = [100, 500, 100, 300]
    r["flags"] = [fmt.OVERLAPPED, 0, 0, 0]
    windows = [1000, 2000 - 1000, 3000 - 2000, 3500 - 3000]
    moved = 1000 - 800  # step 1's launch from 800 to 1300, inside step 0's window [0, 1000]
    times = step_times(r)
    assert list(times) == [windows[0] - moved, windows[1] + moved, windows[2], windows[3]]
    assert times.sum() == sum(windows) and (times >= 0).all()
    assert list(step_times(r[:1])) == [1000] and len(step_times(r[:0])) == 0


def test_unmatched_ends_and_steps_never_ended_are_counted_not_written(tmp_path):
    log = new_log(tmp_path)
    log.end(5, 10)  # never begun
    for step in range(writer_module.PENDING + 1):  # step 0's row is reused by step PENDING: 0 never ended
        log.begin(step, step, 0, 0, 1, 1, 0, 0, 1, fmt.EXTEND)
    log.end(writer_module.PENDING, 99)
    log.close()
    f = read_step_log(log.path)
    assert f.counts["unmatched"] == 2 and list(f.records["step"]) == [writer_module.PENDING]


def test_the_size_cap_truncates_and_counts_every_step_past_it(tmp_path):
    probe = new_log(tmp_path / "probe" if (tmp_path / "probe").mkdir() is None else tmp_path)
    data_offset = probe.data_offset
    probe.close()
    cap = data_offset + 10 * fmt.RECORD_SIZE + 17  # room for 10 whole records
    log = new_log(tmp_path, rank=1, max_bytes=cap, flush_interval=0.01)
    t = time.monotonic_ns()
    for step in range(25):
        extend(log, step, t + step * 1000, 10 + step)
        if step == 5:
            time.sleep(0.05)  # the writer flushes between, as it does at a real scheduler's pace
    log.close()
    assert os.path.getsize(log.path) == data_offset + 10 * fmt.RECORD_SIZE <= cap
    f = read_step_log(log.path)
    assert f.counts["written"] == 10 and f.counts["dropped_cap"] == 15
    assert list(f.records["step"]) == list(range(10))
    out = dpboard("steps", str(log.path))
    assert out.returncode == 0, out.stderr
    assert "15 past the size cap" in out.stdout
    doc = json.loads(dpboard("steps", str(log.path), "--json").stdout)
    assert doc["files"][0]["counts"]["dropped_cap"] == 15 and doc["steps"] == 10


def test_a_full_ring_drops_and_counts_and_the_scheduler_never_waits(tmp_path):
    log = new_log(tmp_path, ring_rows=4, flush_interval=3600)  # the writer thread never gets to flush
    for step in range(10):
        extend(log, step, step, 1)
    assert log.dropped_ring == 6
    log.close()
    f = read_step_log(log.path)
    assert f.counts["dropped_ring"] == 6 and list(f.records["step"]) == [0, 1, 2, 3]


def test_the_scheduler_thread_never_writes_the_file(tmp_path, monkeypatch):
    """Every write is the writer thread's (or close's): the hot path only fills rows."""
    writers: list[str] = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        writers.append(threading.current_thread().name)
        return real(fd, data, offset)

    monkeypatch.setattr(writer_module.os, "pwrite", pwrite)
    log = new_log(tmp_path, flush_interval=0.005)
    writers.clear()  # the prelude and header, written when the log opens
    t = time.monotonic_ns()
    for step in range(2000):
        log.begin(step, t + step, 0, 0, 8, 1, 0, 0, 1, fmt.EXTEND)
        log.end(step, t + step + 1)
        if step % 500 == 0:
            time.sleep(0.02)
    assert writers and set(writers) == {"dpboard-steplog-rank0"}
    log.close()
    assert read_step_log(log.path).counts["written"] == 2000


def test_a_fault_is_counted_logged_once_with_its_traceback_then_at_powers_of_ten(tmp_path, caplog):
    log = new_log(tmp_path)
    caplog.set_level(logging.WARNING, "dpboard.steplog")
    stops = []
    for _ in range(MAX_FAULTS):
        try:
            raise KeyError("forward_mode")
        except KeyError as e:
            stops.append(log.fault(e, "a hook"))
    assert stops[-1] is True and not any(stops[:-1])
    lines = [r for r in caplog.records if "step-log fault" in r.getMessage()]
    assert [r.getMessage().split("#")[1].split(",")[0] for r in lines] == ["1", "10", "100", "1000"]
    assert lines[0].exc_info and not any(r.exc_info for r in lines[1:])
    log.close()
    assert read_step_log(log.path).counts["faults"] == MAX_FAULTS


def test_a_name_taken_gets_another_file_never_the_old_one(tmp_path):
    first = new_log(tmp_path)
    second = new_log(tmp_path)
    assert first.path != second.path and second.path.name.endswith("-rank0-1.bin")
    first.close()
    second.close()


# -- a process killed while it writes --------------------------------------------------------------------------

KILLED_CHILD = """
import sys, time
from dpboard.steplog.writer import StepLog
from dpboard.steplog import format as fmt
log = StepLog(sys.argv[1], engine="test", rank=0, header={"settings": {}}, max_bytes=1 << 20, flush_interval=0.01)
t = time.monotonic_ns()
for step in range(300):
    log.record(t + step * 1000, 900, step, 0, 0, 16, 1, 0, 0, 1, fmt.EXTEND)
while log.written < 300:  # the writer thread's flush, at its own pace
    time.sleep(0.01)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_log_whose_process_was_killed_is_read_with_what_it_flushed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        assert read_line(proc, timeout=30).strip() == "ready"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        kill(proc)
    [path] = step_log_paths(tmp_path)
    f = read_step_log(path)
    assert not f.closed and f.counts["written"] == 300 and list(f.records["step"]) == list(range(300))
    out = dpboard("steps", str(tmp_path))
    assert out.returncode == 0 and "not closed" in out.stdout


# -- the settings ------------------------------------------------------------------------------------------------


def test_unset_is_off_and_a_directory_is_on(tmp_path):
    assert step_log_settings({}) is None and step_log_settings({ENV_STEP_LOG: " "}) is None
    got = step_log_settings({ENV_STEP_LOG: str(tmp_path)})
    assert got.directory == tmp_path and got.max_bytes == 64 << 20
    assert step_log_settings({ENV_STEP_LOG: str(tmp_path), ENV_MAX_MIB: "2"}).max_bytes == 2 << 20


def test_a_bad_directory_is_refused_naming_the_variable_and_the_fix(tmp_path):
    with pytest.raises(InvalidInputError, match=r"DPBOARD_STEP_LOG='.*/nope': no such directory; create it \(mkdir"):
        step_log_settings({ENV_STEP_LOG: str(tmp_path / "nope")})
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidInputError, match="DPBOARD_STEP_LOG=.* is not a directory"):
        step_log_settings({ENV_STEP_LOG: str(tmp_path / "file")})
    with pytest.raises(InvalidInputError, match="DPBOARD_STEP_LOG_MAX_MIB='0': 0 is outside"):
        step_log_settings({ENV_STEP_LOG: str(tmp_path), ENV_MAX_MIB: "0"})


def test_a_directory_this_process_cannot_write_is_refused(tmp_path):
    """As this user when it is not root; as uid 65534 (a forked child) when it is: root writes anywhere."""
    def refused(path: str) -> str:
        try:
            step_log_settings({ENV_STEP_LOG: path})
        except InvalidInputError as e:
            return str(e)
        return "accepted"

    if os.geteuid() != 0:
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o555)
        message = refused(str(locked))
        assert "DPBOARD_STEP_LOG=" in message and "cannot write in that directory" in message, message
        return
    # tmp_path's parents are root's own (0700): that user cannot even reach it
    message = as_nobody(lambda: refused(str(tmp_path)))
    assert "DPBOARD_STEP_LOG=" in message and "cannot reach that directory (Permission denied)" in message
    outer = tempfile.mkdtemp(prefix="dpboard-steplog-")  # in /tmp, which anyone may cross
    try:
        os.chmod(outer, 0o711)
        locked = os.path.join(outer, "ro")
        os.mkdir(locked, 0o555)
        message = as_nobody(lambda: refused(locked))
        assert "DPBOARD_STEP_LOG=" in message and "cannot write in that directory" in message, message
    finally:
        shutil.rmtree(outer)


# -- the summary and the command ---------------------------------------------------------------------------------


def two_rank_logs(tmp_path) -> list:
    paths = []
    for rank in (0, 1):
        log = new_log(tmp_path, rank=rank)
        t, step = 0, 0
        for _ in range(4):  # a prefill of 1,000 tokens in 2 ms, then decodes of 8 requests in 1 ms each
            extend(log, step, t, 1000, duration=2_000_000)
            t, step = t + 2_000_000, step + 1
            for _ in range(5):
                decode(log, step, t, 8, 8 * 500, duration=1_000_000)
                t, step = t + 1_000_000, step + 1
        log.record(t, 500_000, step, 0, 0, 0, 0, 0, 0, 0, fmt.IDLE, fmt.GROUP_EXTEND)
        log.close()
        paths.append(log.path)
    return paths


def test_the_summary_counts_modes_and_times_per_token_and_request(tmp_path):
    summary = summarize([read_step_log(p) for p in two_rank_logs(tmp_path)])
    assert summary["steps"] == 2 * 25
    assert {m: v["steps"] for m, v in summary["modes"].items()} == {"extend": 8, "decode": 40, "idle": 2}
    assert summary["modes"]["extend"]["p50_ms"] == pytest.approx(2.0)
    assert summary["modes"]["decode"]["p90_ms"] == pytest.approx(1.0)
    assert summary["per_prefill_token_us"]["mean_us"] == pytest.approx(2.0)  # 2 ms / 1,000 tokens
    assert summary["per_decode_request_us"]["mean_us"] == pytest.approx(125.0)  # 1 ms / 8 requests
    assert summary["per_decode_request_us"]["mean_context_tokens"] == pytest.approx(500)
    assert {(b["mode"], b["batch"]): b["steps"] for b in summary["batch"]} == {
        ("extend", "1"): 8, ("decode", "8-15"): 40, ("idle", "0"): 2}
    assert summary["flags"]["group_extend"] == 2
    text = render(summary)
    assert "50 steps in 2 step logs" in text and "time per prefill token: 2.000 µs" in text


def test_the_steps_command_reads_a_directory_as_text_and_json(tmp_path):
    two_rank_logs(tmp_path)
    out = dpboard("steps", str(tmp_path))
    assert out.returncode == 0, out.stderr
    for words in ("steps by mode", "extend", "decode", "idle", "step time by mode and batch size",
                  "time per decode request: 125.000 µs", "max_total_tokens 100000", "overlap on"):
        assert words in out.stdout
    doc = json.loads(dpboard("steps", str(tmp_path), "--json").stdout)
    assert [f["rank"] for f in doc["files"]] == [0, 1] and doc["modes"]["decode"]["steps"] == 40


def test_what_is_not_a_step_log_is_one_line_and_status_2(tmp_path):
    (tmp_path / "steps-x.bin").write_bytes(b"not a log at all" * 10)
    out = dpboard("steps", str(tmp_path / "steps-x.bin"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "is not a dpboard step log" in out.stderr
    out = dpboard("steps", str(tmp_path / "empty"))
    assert out.returncode == 2 and "no step log or directory" in out.stderr
    (tmp_path / "d").mkdir()
    out = dpboard("steps", str(tmp_path / "d"))
    assert out.returncode == 2 and "no step log (steps-*.bin) in" in out.stderr


def test_a_later_version_or_a_record_size_its_version_does_not_have_is_refused(tmp_path):
    later = tmp_path / "steps-sglang-3-rank0.bin"
    write_log_by_hand(later, 3, 80, [(0,) * 10], pack=struct.Struct("<10q").pack)
    with pytest.raises(InvalidInputError) as e:
        read_step_log(later)
    message = str(e.value)
    assert str(later) in message and "format version 3 with 80-byte records" in message
    assert "this dpboard reads versions 1 to 2 (64-byte records in version 1, 72-byte records in version 2)" in message
    assert "read it with the dpboard that wrote it" in message
    wrong = tmp_path / "steps-sglang-2-rank0.bin"
    write_log_by_hand(wrong, 2, 64, [(0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0)])  # version 1's records, marked 2
    with pytest.raises(InvalidInputError, match="format version 2 with 64-byte records; this dpboard reads"):
        read_step_log(wrong)


def test_the_reader_and_the_summary_import_no_numba_or_cupy(tmp_path):
    code = ("import sys, dpboard.steplog.summary, dpboard.steplog.reader; "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'cupy')) != [])")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0
