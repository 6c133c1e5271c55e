"""The controller's connections under a flood, end to end: a real `dpboard controller` process at a
lowered fd limit, silent TCP peers on its input, a scheduler that does not read, frames with
megabyte rids (dpboard.controller.connections)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from dpboard.controller.codec import encode_request
from tests.support.flood import SilentFlood, cpu_share, free_port, limit_fds, open_fds, rss_mib
from tests.support.names import ROOT
from tests.support.procutil import kill, wait_for, wait_until
from tests.support.sockets import bound_pull, connected_push

FD_LIMIT = 256
FLOOD = 300  # silent connections: more than the controller has fds
# CPU-seconds per wall second: the unguarded listener spinning on EMFILE measured 0.43-0.51 here;
# guarded, 0.04 (the flood's replacements cost it accepts and closes). Generous, far below a spin.
CPU_BOUND = 0.2


def _controller(*args: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dpboard.cli", "controller", *args, "--log-every", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, **popen)


def _stats(proc: subprocess.Popen, log: str = "") -> tuple[dict, str]:
    """SIGTERM, and the final counts; ``log``: what ``_read_log_until`` already read of stderr."""
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    err = log + (err or "")  # None when stderr went to a file
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _read_log_until(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """The controller's log up to the first line that holds ``text`` (read in a thread: a line may take
    the whole ``timeout``). Lines read past it with it are not in ``_stats``'s log."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"no {text!r} in the controller's log: {''.join(lines)[-3000:]}"
    return "".join(lines)


def _take(sock: zmq.Socket, n: int, timeout: float) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        if sock.poll(50):
            got.append(msgpack.unpackb(sock.recv(), raw=False))
    return got


@pytest.mark.timeout(120)
def test_real_requests_flow_while_silent_connections_flood_the_input(tmp_path):
    """300 TCP connections that never speak, against a controller at `ulimit -n 256`: they once took
    every fd (0 of 50 real requests got in, the listener spun on EMFILE at ~0.5 CPU). The input now
    holds at most what the fd limit leaves, closes silent peers first (and any after 5 s), and a
    real tokenizer connecting in the middle of the flood gets all 50 requests through."""
    port = free_port()
    in_ep, w_ep = f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/sched"
    ctx = zmq.Context()
    pull = bound_pull(ctx, w_ep)
    proc = _controller("--input", in_ep, "--workers", w_ep, "--method", "round_robin", "--stats-json",
                       preexec_fn=limit_fds(FD_LIMIT))
    try:
        probe = connected_push(ctx, in_ep)
        probe.send(encode_request("probe", num_tokens=1))
        assert _take(pull, 1, 20), "the controller never served"
        probe.close(linger=0)
        with SilentFlood(port, keep_open=FLOOD, total=6000, seconds=40) as flood:
            wait_for(lambda: flood.opened >= FLOOD, 20, "the flood to open its connections")
            busy = cpu_share(proc.pid, 3.0)
            fds = open_fds(proc.pid)
            push = connected_push(ctx, in_ep)  # a tokenizer arriving in the middle of the flood
            for i in range(50):
                push.send(encode_request(f"r{i}", num_tokens=5))
            got = _take(pull, 50, 20)
            flooding = flood.running
            print(f"flood opened {flood.opened}, {flood.closed_by_peer} closed by the controller; its fds {fds}/"
                  f"{FD_LIMIT}, CPU {busy:.2f}; {len(got)} of 50 requests through")
        assert flooding, "the flood ended before the requests were sent: the test proved nothing"
        assert sorted(m["rid"] for m in got) == sorted(f"r{i}" for i in range(50))
        assert busy < CPU_BOUND, f"the controller used {busy:.2f} CPU-seconds per second under the flood"
        assert fds < FD_LIMIT
        stats, _ = _stats(proc)
        assert stats["input"]["shed"] > 0 and stats["input"]["max_peers"] < FD_LIMIT
        assert stats["dispatched"] == 51
    finally:
        kill(proc)
        ctx.destroy(linger=0)


def _rid(frame: bytes) -> object:
    """The rid of a request frame whose first key is ``rid``, read from its first bytes (the rest may
    be megabytes)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(frame[:256])
    unpacker.read_map_header()
    assert unpacker.unpack() == "rid"
    return unpacker.unpack()


class _Reader:
    """A scheduler that reads, or the tokenizer side's error PULL: a thread takes every message and
    keeps its rid (``rids``, in order)."""

    def __init__(self, sock: zmq.Socket, *, answers: bool = False) -> None:
        self.sock, self.answers = sock, answers
        self.rids: list[object] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            if self.sock.poll(50):
                frame = self.sock.recv()
                self.rids.append(msgpack.unpackb(frame, raw=False)["rid"] if self.answers else _rid(frame))

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)


def _accounted(stats: dict, sent: list[str], readers: dict[str, _Reader], stuck: zmq.Socket,
               from_stuck: list[object]) -> None:
    """Every request sent ends in exactly one place: a scheduler that read it, the one that did not
    (read now), or an answer on --errors; the controller's counts say the same. Waits for what is
    still on its way (each bounded), never for a time."""
    per_rank, rejected = stats["per_rank"], stats["rejected"]
    assert stats["received"] == len(sent) and sum(per_rank) + rejected == len(sent), stats
    from_stuck += [_rid(m) for m in _take_raw(stuck, per_rank[0] - len(from_stuck), 30)]
    wait_for(lambda: len(readers["good"].rids) >= per_rank[1] and len(readers["errors"].rids) >= rejected, 30,
             f"the {per_rank[1]} requests sent to the reading scheduler and the {rejected} answers")
    good, answered = readers["good"].rids, readers["errors"].rids
    assert (len(from_stuck), len(good), len(answered)) == (per_rank[0], per_rank[1], rejected)
    assert sorted(map(str, from_stuck + good + answered)) == sorted(sent)


def _take_raw_until_quiet(sock: zmq.Socket, quiet: float = 2.0, timeout: float = 60.0) -> list[bytes]:
    """Every message ``sock`` gets until none came for ``quiet`` seconds (at most ``timeout``)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sock.poll(int(quiet * 1000)):
        got.append(sock.recv())
    return got


def _take_raw(sock: zmq.Socket, n: int, timeout: float) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        if sock.poll(50):
            got.append(sock.recv())
    return got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_scheduler_that_does_not_read_gets_a_bounded_backlog_and_the_rest_goes_elsewhere(tmp_path, transport):
    """96 frames of 8 MiB, round robin over a scheduler that is connected but does not read and one
    that does: the controller used to queue 48 of them for the first (RSS from 45 to 413 MiB; 829 MiB
    unpaced). With --max-queued-mib 16 the first is unavailable once 16 MiB wait for it, the others
    go to the second, and the controller's peak memory stays within the bound and a few frames.
    Over TCP the kernel says exactly what it took; over a Unix socket, whether its buffer has room.

    On a loaded machine the reading scheduler (a thread of this test) falls behind too at times: then
    no rank takes a request, and the controller answers it on --errors (under tools/cpu_hog.py, 10 of
    97 once, which this test counted as lost before it listened there). Every request ends in exactly
    one place: a scheduler, or an answer."""
    eps = ([f"tcp://127.0.0.1:{free_port()}" for _ in range(2)] if transport == "tcp"
           else [f"ipc://{tmp_path}/sched-{r}" for r in range(2)])
    in_ep, err_ep = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/errors"
    ctx = zmq.Context()
    # the stuck scheduler: its ZMQ stops reading the socket at one message, the kernel fills, then the controller
    stuck = bound_pull(ctx, eps[0], rcvhwm=1)
    readers = {"good": _Reader(bound_pull(ctx, eps[1])), "errors": _Reader(bound_pull(ctx, err_ep), answers=True)}
    proc = _controller("--input", in_ep, "--workers", *eps, "--errors", err_ep, "--method", "round_robin",
                       "--stats-json", "--max-queued-mib", "16", "--max-input-mib", "64")
    try:
        push = connected_push(ctx, in_ep)
        sent = ["probe"]
        push.send(encode_request("probe", num_tokens=1, routed_dp_rank=1))
        wait_for(lambda: readers["good"].rids, 20, "the controller to serve")
        base = rss_mib(proc.pid)
        pad = b"x" * (8 * 2**20)
        for i in range(96):
            before = len(readers["good"].rids)
            sent.append(f"r{i}")
            push.send(msgpack.packb({"rid": f"r{i}", "num_tokens": 5, "pad": pad}))
            # one frame at a time through the controller: what it holds is its send queues, not its input's
            wait_until(lambda before=before: len(readers["good"].rids) > before, timeout=0.3)
        # after every frame on the same connection: once it is through or answered, all were placed
        sent.append("last")
        push.send(encode_request("last", num_tokens=1, routed_dp_rank=1))
        wait_for(lambda: "last" in readers["good"].rids or "last" in readers["errors"].rids, 60,
                 "the last request (sent after the others) to arrive or be answered")
        peak = rss_mib(proc.pid, "VmHWM") - base
        # what was queued for the stuck scheduler comes once it reads (before the controller stops:
        # at its exit, what it holds has a second to leave)
        from_stuck = [_rid(m) for m in _take_raw_until_quiet(stuck)]
        stats, err = _stats(proc)
        print(f"per rank {stats['per_rank']}, rejected {stats['rejected']}, peak RSS {peak:.0f} MiB over "
              f"{base:.0f}, backlogged {stats['backlogged']}")
        _accounted(stats, sent, readers, stuck, from_stuck)
        # 16 MiB in the controller (two frames, a third taking it over), and what the kernel's buffers and the
        # stuck scheduler's ZMQ took (6 frames here): never the 48 that round robin gives it
        assert 2 <= stats["per_rank"][0] <= 16, stats["per_rank"]
        assert stats["per_rank"][1] >= 96 - 16 - stats["rejected"]
        assert stats["backlogged"] >= 1 and stats["errors_unsent"] == 0
        assert peak < 16 + 8 * 8 + 64, f"the controller's memory grew by {peak:.0f} MiB"
        assert "holds" in err and "--max-queued-mib" in err
    finally:
        for reader in readers.values():
            reader.close()
        kill(proc)
        ctx.destroy(linger=0)


@pytest.mark.timeout(180)
def test_frames_sent_faster_than_the_controller_reads_wait_in_the_sender(tmp_path):
    """96 frames of 8 MiB sent at once while the controller does not read its input (it gives a third
    scheduler, which never comes, 2 s to connect), then round robin over a scheduler that does not read
    and one that does. ZMQ bounds its receive queue in messages only (1 000): the controller took all
    96 in and read them in one batch, from 45 MiB to 0.6-1.3 GB. With --max-input-mib 64 (two frames
    of 32 MiB) a connection's unread frames are at most 3 here, one read takes at most 16 MiB (and the
    frame that crosses it), and the rest waits in the sender; every request still ends in exactly one
    place, a scheduler or an answer on --errors."""
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    in_ep, err_ep = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/errors"
    ctx = zmq.Context()
    stuck = bound_pull(ctx, eps[0], rcvhwm=1)
    readers = {"good": _Reader(bound_pull(ctx, eps[1])), "errors": _Reader(bound_pull(ctx, err_ep), answers=True)}
    absent = f"ipc://{tmp_path}/never-bound"
    proc = _controller("--input", in_ep, "--workers", *eps, absent, "--errors", err_ep, "--method", "round_robin",
                       "--stats-json", "--max-queued-mib", "16", "--max-input-mib", "64")
    try:
        # its first line from its loop: its sockets are made, and it now waits for the absent scheduler
        log = _read_log_until(proc, "controller: method", 30)
        base = rss_mib(proc.pid)
        # the sender queues little itself: what the controller does not take waits in its send call
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 2)
        push.setsockopt(zmq.SNDTIMEO, 60_000)
        push.connect(in_ep)
        sent = [f"r{i}" for i in range(96)] + ["last"]
        pad = b"x" * (8 * 2**20)
        for i in range(96):
            push.send(msgpack.packb({"rid": f"r{i}", "num_tokens": 5, "pad": pad}))
        # after every frame on the same connection: once it is through or answered, all were placed
        push.send(encode_request("last", num_tokens=1, routed_dp_rank=1))
        wait_for(lambda: "last" in readers["good"].rids or "last" in readers["errors"].rids, 90,
                 "the last request (sent after the others) to arrive or be answered")
        peak = rss_mib(proc.pid, "VmHWM") - base
        from_stuck = [_rid(m) for m in _take_raw_until_quiet(stuck)]
        stats, _ = _stats(proc, log)
        print(f"peak RSS {peak:.0f} MiB over {base:.0f}; per rank {stats['per_rank']}, rejected {stats['rejected']}; "
              f"input {stats['input']}")
        # unread: 2 frames queued and one being read; one read: 16 MiB and the frame that crosses it; the
        # two schedulers' pipes: 16 MiB and one frame each; and room for the allocator and a few copies
        bound = 3 * 8 + (16 + 8) + 2 * (16 + 8) + 64
        assert peak < bound, f"the controller's memory grew by {peak:.0f} MiB (bound {bound})"
        assert stats["input"]["hwm_frames"] == 2 and stats["input"]["largest_read_bytes"] < (16 + 9) * 2**20
        _accounted(stats, sent, readers, stuck, from_stuck)
    finally:
        for reader in readers.values():
            reader.close()
        kill(proc)
        ctx.destroy(linger=0)


def test_an_input_bound_below_one_frame_is_refused_naming_the_frame(tmp_path):
    """ZMQ's receive high-water mark is --max-input-mib over the largest frame: below one frame it
    would bound nothing it says."""
    out = subprocess.run([sys.executable, "-m", "dpboard.cli", "controller", "--input", f"ipc://{tmp_path}/in",
                          "--workers", f"ipc://{tmp_path}/w", "--max-input-mib", "8"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--max-input-mib: 8 is outside [32, 1048576]: room for one frame of the largest size (32 MiB)" in out.stderr


@pytest.mark.timeout(120)
def test_malformed_frames_with_megabyte_rids_cost_a_few_log_lines(tmp_path):
    """100 malformed frames whose rid is 1 MiB once added 100 MiB to the controller's log (the whole
    rid in every line). Each line now carries at most 200 characters of it, at most 10 such lines
    per 10 s are written and the rest are counted in one line; every frame is still answered."""
    in_ep, w_ep, err_ep = (f"ipc://{tmp_path}/{n}" for n in ("in", "sched", "err"))
    ctx = zmq.Context()
    bound_pull(ctx, w_ep)
    errors = bound_pull(ctx, err_ep)
    log_path = tmp_path / "controller.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "controller", "--input", in_ep, "--workers",
                                 w_ep, "--errors", err_ep, "--method", "round_robin", "--stats-json",
                                 "--log-every", "60",
                                 # room for all 100 answers (a 1 MiB rid each): this test is about the log;
                                 # the answers' byte bound has a test of its own, below
                                 "--max-queued-mib", "256"],
                                stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=ROOT)
    try:
        push = connected_push(ctx, in_ep)
        rid = "r" * 2**20
        for i in range(100):
            push.send(msgpack.packb({"rid": f"{i}-{rid}", "input_ids": "not a list"}))
        answers = _take(errors, 100, 60)
        assert len(answers) == 100 and all("input_ids must be a list" in a["error"] for a in answers)
        stats, _ = _stats(proc)
        size = os.path.getsize(log_path)
        text = log_path.read_text()
        print(f"log {size} bytes for {stats['malformed']} malformed frames; {stats.get('log_held_back')} lines held back")
        assert stats["malformed"] == 100 and stats["log_held_back"] == 90
        assert size < 64 * 1024, f"the log grew by {size} bytes"
        assert len(re.findall("dropped a malformed request frame", text)) == 10
        assert "(1048578 characters)" in text and "90 more such lines" in text
    finally:
        kill(proc)
        ctx.destroy(linger=0)


@pytest.mark.timeout(120)
def test_answers_a_tokenizer_does_not_read_stay_within_the_byte_bound(tmp_path):
    """A malformed frame whose rid could be read is answered with that rid, on --errors. A tokenizer
    side that does not read its answers once let them queue without a byte bound: 150 rids of 1 MiB
    held 150 MiB in the controller. They now stop at --max-queued-mib; the rest are counted unsent."""
    in_ep, w_ep, err_ep = (f"ipc://{tmp_path}/{n}" for n in ("in", "sched", "err"))
    ctx = zmq.Context()
    pull = bound_pull(ctx, w_ep)
    errors = bound_pull(ctx, err_ep, rcvhwm=1)  # bound, connected, never read
    proc = _controller("--input", in_ep, "--workers", w_ep, "--errors", err_ep, "--method", "round_robin",
                       "--stats-json", "--max-queued-mib", "16", "--max-input-mib", "64")
    try:
        push = connected_push(ctx, in_ep)
        push.send(encode_request("probe", num_tokens=1))
        assert _take(pull, 1, 20), "the controller never served"
        base = rss_mib(proc.pid)
        rid = "r" * 2**20
        for i in range(150):
            push.send(msgpack.packb({"rid": f"{i}-{rid}", "input_ids": "not a list"}))
        push.send(encode_request("last", num_tokens=1))  # after every malformed one, on the same connection
        assert _take(pull, 1, 60), "the controller never got to the last request"
        peak = rss_mib(proc.pid, "VmHWM") - base
        stats, err = _stats(proc)
        print(f"answers: {150 - stats['errors_unsent']} queued or sent, {stats['errors_unsent']} unsent; "
              f"peak RSS {peak:.0f} MiB over {base:.0f}")
        assert stats["malformed"] == 150 and stats["errors_unsent"] > 0
        # the bound, two frames in flight, and room for the 1 MiB requests still in ZMQ's input queue
        # and in one read: still less than the 150 MiB of answers alone unbounded
        assert peak < 16 + 2 * 8 + 112, f"the controller's memory grew by {peak:.0f} MiB"
        assert "the error channel" in err
    finally:
        errors.close(linger=0)
        kill(proc)
        ctx.destroy(linger=0)
