"""DPBOARD_METHOD=inflight_wave in SGLang's real DataParallelController, run by its own ``event_loop``.

The controller is made as test_dispatch.py makes it (real zmq PUSH sockets per rank, read back here
by PULL sockets) under DP attention, and its own ``event_loop`` runs in a thread: requests come in
through a real PUSH socket to its ``recv_from_tokenizer``, as the tokenizer sends them, and the hold
is timed by nothing but that loop's turns. The loop is stopped as SGLang's stops on a bad request:
one routed to a rank that does not exist raises out of it.

The board says every rank decodes (8 running, 400 tokens/s: a group step of 20 ms), so that an
arrival is held; DPBOARD_WAVE_MAX_HOLD=1 and DPBOARD_WAVE_PER_RANK=2 (a wave of 6 on 3 ranks).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import zmq

from tests.integrations.sglang.real.test_dispatch import (  # noqa: F401  (the launch's stand-in, autouse)
    Cluster,
    dispatching,
    io,
    launch_without_processes,
    req,
)
from tests.support import sglang as sgl

pytestmark = pytest.mark.timeout(120)

MAX_HOLD = 1.0
STEP = 8 / 400  # running over gen_throughput: the group step the board reports
PER_RANK = 2
# near a rank's prefill chunk (SGLang's 8192 over the 3 ranks): the lockstep pick spreads such prompts
PROMPT = 2000
STOP_RANK = 99  # a routed rank that does not exist: SGLang's loop raises on it, and ends


@dataclass
class Control:
    """A message SGLang's controller does not know: it forwards it with ``send_control_message``."""

    rid: str


def decode(cluster: Cluster, running: int | list[int], k: int) -> None:
    """Every rank's slot: ``running`` requests decoding (one count, or one per rank), nothing
    waiting, 400 tokens/s, colocated (full_snapshot gives ranks 0 and 1 a PD role)."""
    for rank, writer in enumerate(cluster.writers):
        n = running[rank] if isinstance(running, list) else running
        snap = sgl.full_snapshot(rank, k)
        colocated = msgspec.structs.replace(snap.disaggregation, mode="null")  # no PD role: every rank decodes
        writer.write(msgspec.structs.replace(snap, num_running_reqs=n, num_waiting_reqs=0,
                                             num_waiting_uncached_tokens=0, gen_throughput=400.0,
                                             num_total_tokens=1000, disaggregation=colocated))


def arrivals(cluster: Cluster, within: float) -> list[tuple[float, int, str]]:
    """(time, rank, rid) of each message the ranks receive within ``within`` seconds."""
    poller = zmq.Poller()
    for sock in cluster.pulls:
        poller.register(sock, zmq.POLLIN)
    out = []
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, int(left * 1000))))
        for rank, sock in enumerate(cluster.pulls):
            if sock in ready:
                out.append((time.monotonic(), rank, sock.recv_pyobj().rid))
    return out


@contextlib.contextmanager
def looping(cluster: Cluster) -> Iterator[zmq.Socket]:
    """SGLang's ``event_loop`` in a thread, and the tokenizer's PUSH socket into it."""
    controller = cluster.controller
    ended: list[BaseException] = []

    def run() -> None:
        try:
            controller.event_loop()
        except BaseException as e:  # the stop request, or what the test must see
            ended.append(e)

    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(controller.port_args.scheduler_input_ipc_name)  # the tokenizer binds, the controller connects
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.05)  # let the controller's PULL socket connect before the first send
    try:
        yield push
    finally:
        push.send_pyobj(req("stop", routed=STOP_RANK))
        thread.join(timeout=10)
        push.close(linger=0)
        assert not thread.is_alive(), "SGLang's event loop did not stop"
        assert len(ended) == 1 and isinstance(ended[0], ValueError), ended
        assert f"DP rank {STOP_RANK} is not active." in str(ended[0])


@pytest.fixture
def wave(instance, tmp_path, monkeypatch) -> Iterator[Cluster]:
    monkeypatch.setenv("DPBOARD_WAVE_MAX_HOLD", str(MAX_HOLD))
    monkeypatch.setenv("DPBOARD_WAVE_PER_RANK", str(PER_RANK))
    with dispatching(instance, tmp_path, monkeypatch, "inflight_wave", stale_after="60",
                     attn_dp_enabled=True) as cluster:
        decode(cluster, 8, 1)
        yield cluster


def held_by(cluster: Cluster) -> int:
    return cluster.controller._dpboard_dispatch.dispatcher.held


def test_a_lone_arrival_is_held_while_the_group_decodes_and_leaves_at_its_bound(wave):
    with looping(wave) as push:
        sent = time.monotonic()
        push.send_pyobj(req("lone", 100))
        got = arrivals(wave, 3 * MAX_HOLD)
    assert [rid for _, _, rid in got] == ["lone"], got
    waited = got[0][0] - sent
    # held its bound (the hold less the group step the board reports), then placed by a turn of the loop
    assert MAX_HOLD - STEP - 0.05 <= waited <= MAX_HOLD + 0.5, waited
    wave_hold = wave.controller._dpboard_dispatch.dispatcher.wave
    assert wave_hold.released["bound"] == 1 and held_by(wave) == 0


def test_a_full_wave_leaves_at_once_spread_over_the_ranks(wave):
    with looping(wave) as push:
        sent = time.monotonic()
        for i in range(PER_RANK * 3):  # prompts near a rank's chunk: two on one rank cost it a step more
            push.send_pyobj(req(f"w{i}", PROMPT))
        got = arrivals(wave, MAX_HOLD / 2)
    assert sorted(rid for _, _, rid in got) == [f"w{i}" for i in range(6)], got
    assert max(t for t, _, _ in got) - sent < MAX_HOLD - STEP - 0.05  # before any bound: the wave was full
    per_rank = [sum(1 for _, rank, _ in got if rank == r) for r in range(3)]
    assert per_rank == [PER_RANK] * 3, got
    assert wave.controller._dpboard_dispatch.dispatcher.wave.released["full"] == 6


def test_nothing_is_held_when_no_rank_decodes(wave):
    decode(wave, 0, 2)
    time.sleep(0.05)  # past the dispatcher's 20 ms between reads of the board
    with looping(wave) as push:
        sent = time.monotonic()
        push.send_pyobj(req("idle", 100))
        got = arrivals(wave, MAX_HOLD / 2)
    assert [rid for _, _, rid in got] == ["idle"], got
    assert got[0][0] - sent < MAX_HOLD / 2
    assert wave.controller._dpboard_dispatch.dispatcher.wave.held_total == 0


@pytest.mark.parametrize("message", ["control", "profile"])
def test_a_message_to_the_schedulers_never_overtakes_a_held_request(wave, message):
    """SGLang forwards an abort, a flush or its ShutdownReq with send_control_message, a profile or a
    block with send_to_all_workers: what is held goes out first. Rank 0 runs the fewest, so the held
    request goes there, as does either message (under DP attention a control message goes to every
    tp_size-th rank: 0 and 2)."""
    decode(wave, [4, 8, 8], 2)
    time.sleep(0.05)
    with looping(wave) as push:
        push.send_pyobj(req("held", 100))
        assert not arrivals(wave, 0.2)  # held
        push.send_pyobj(Control("ctl") if message == "control" else io.ProfileReq(rid="ctl"))
        got = arrivals(wave, MAX_HOLD / 2)
    assert [rid for _, rank, rid in got if rank == 0] == ["held", "ctl"], got
    assert wave.controller._dpboard_dispatch.dispatcher.wave.released["order"] == 1


def test_a_fault_in_the_hold_sends_what_it_held_and_is_counted(wave, monkeypatch):
    """A bug in the wave's rule: the held request still goes out, through the fallback of a release,
    and the session counts the fault."""
    session = wave.controller._dpboard_dispatch
    with looping(wave) as push:
        push.send_pyobj(req("held", 100))
        assert not arrivals(wave, 0.2)

        def broken() -> list:
            raise RuntimeError("a bug in due")

        monkeypatch.setattr(session.dispatcher, "due", broken)
        got = arrivals(wave, 3 * MAX_HOLD)
    assert [rid for _, _, rid in got] == ["held"], got
    assert session.faults == 1 and held_by(wave) == 0
