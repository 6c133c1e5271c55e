"""An engine core killed mid-stream, two ways an API server can hold it.

Engines the API server started (vLLM's ``CoreEngineProcManager``): vLLM's own death path runs. Its
monitor thread sees the process end, marks the client dead and shuts it down (the live engine is
stopped too); the output task is cancelled and puts ``EngineDeadError`` on the outputs queue;
``AsyncLLM``'s output handler hands it to every pending request (``OutputProcessor.propagate_error``);
a request added after that is refused with it. Every request is answered: finished, or
``EngineDeadError``.

Engines the API server did not start (another node's, or ``--data-parallel-external-lb``): vLLM's
monitor watches only the processes its manager started, so nothing in vLLM 0.33.0 answers the dead
engine's requests; the board is what notices: its slot goes stale and later picks leave it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq
import zmq.asyncio
from vllm.sampling_params import RequestOutputKind
from vllm.utils.network_utils import get_open_zmq_ipc_path, make_zmq_socket
from vllm.utils.system_utils import get_mp_context
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core_client import DPLBAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import RequestOutputCollector

from dpboard.board import Board
from dpboard.integrations.vllm import dispatch
from dpboard.snapshot import SlotStatus
from tests.integrations.vllm.real.conftest import vllm_config
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, wait_until
from tests.support.vllm_engine import connect_client, engine_manager, make_async_llm, make_client
from tests.support.vllm_engine_proc import serve

pytestmark = pytest.mark.timeout(240)
STALE_AFTER = 1.0
REQUESTS = 90
KILL_AT = 30
TOKENS = 10


def live_reader(board_name: str, stale_after: float):
    """The board's reader once both engines' slots are LIVE."""
    reader = Board.attach(board_name).reader(stale_after=stale_after)
    assert wait_until(lambda: all(reader.status(r) is SlotStatus.LIVE for r in range(2)), timeout=30)
    return reader


@contextlib.contextmanager
def picking_client(config):
    """A DPLBAsyncMPClient over two engines picking through the board, as the patched ``__init__``
    makes it, and its ClientDispatch; closed at the end."""
    client = make_client(config, 2)
    state = dispatch.client_dispatch(client)
    setattr(client, dispatch.STATE, state)
    try:
        yield client, state
    finally:
        state.close()


@contextlib.contextmanager
def engines_the_server_did_not_start():
    """Two engine-core processes (tests/support/vllm_engine_proc.py) with the plugin, each ready;
    killed at the end."""
    env = {**os.environ, "VLLM_PLUGINS": "dpboard"}
    engines = [subprocess.Popen([sys.executable, "-m", "tests.support.vllm_engine_proc", str(r), "2"], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for r in range(2)]
    try:
        for proc in engines:
            assert json.loads(read_line(proc, timeout=120)) == {"ready": True}
        yield engines
    finally:
        for proc in engines:
            kill(proc)


def test_an_engine_killed_mid_stream_leaves_no_request_unanswered(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    monkeypatch.setenv("DPBOARD_STALE_AFTER", str(STALE_AFTER))
    monkeypatch.setenv("VLLM_PLUGINS", "dpboard")  # the spawned engine cores load dpboard's plugin
    procs: list = []
    try:
        asyncio.run(asyncio.wait_for(_serve_and_kill(board_name, procs), timeout=200))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


async def _serve_and_kill(board_name: str, procs: list) -> None:
    config = vllm_config(2)
    ctx = zmq.asyncio.Context()
    input_address, output_address = get_open_zmq_ipc_path(), get_open_zmq_ipc_path()
    input_socket = make_zmq_socket(ctx, input_address, zmq.ROUTER, bind=True)
    output_socket = make_zmq_socket(ctx, output_address, zmq.PULL, bind=True)
    context = get_mp_context()
    procs.extend(context.Process(target=serve, name=f"EngineCore_DP{rank}",
                                 args=(rank, 2, input_address, output_address)) for rank in range(2))
    for proc in procs:
        proc.start()
    ready = set()
    while len(ready) < 2:  # each engine's first message on the input socket ends its handshake
        identity, _ = await asyncio.wait_for(input_socket.recv_multipart(), timeout=120)
        ready.add(identity)
    reader = live_reader(board_name, STALE_AFTER)
    client = make_client(config, 2)
    state = dispatch.client_dispatch(client)
    setattr(client, dispatch.STATE, state)
    connect_client(client, ctx, engine_manager(procs), input_socket, output_socket)
    llm = make_async_llm(client, config)
    llm._run_output_handler()
    picked: dict[str, int] = {}
    pick = client.get_core_engine_for_request

    def recording_pick(request):
        engine = pick(request)
        picked[request.external_req_id] = int.from_bytes(engine, "little")
        return engine

    client.get_core_engine_for_request = recording_pick
    answers: dict[str, object] = {}

    async def generate(rid: str) -> None:  # what AsyncLLM.generate does with a request's collector
        from tests.support.vllm_engine import engine_request

        request = engine_request(rid, 32, TOKENS)
        InputProcessor.assign_request_id(request)  # vLLM's internal id: rid and 8 random characters
        collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, request.request_id)
        try:
            await llm._add_request(request, None, None, 0, collector)
            while not (out := await collector.get()).finished:
                pass
            answers[rid] = out.outputs[0].token_ids
        except EngineDeadError as e:
            answers[rid] = e

    try:
        tasks = []
        killed_at = None
        for i in range(REQUESTS):
            rid = f"r{i}"
            tasks.append(asyncio.create_task(generate(rid)))
            await asyncio.sleep(0.02)
            # killed mid-stream: just after it was sent a request, which takes it TOKENS steps
            if killed_at is None and i >= KILL_AT and picked.get(rid) == 1:
                finished_before = {r for r, a in answers.items() if isinstance(a, list)}
                os.kill(procs[1].pid, signal.SIGKILL)
                killed_at = i
        assert killed_at is not None, picked
        done, pending = await asyncio.wait(tasks, timeout=60)
        assert not pending, f"{len(pending)} requests left unanswered"
    finally:
        state.close()
        client.shutdown()
    # every request was answered: its tokens, or vLLM's engine-dead error
    assert set(answers) == {f"r{i}" for i in range(REQUESTS)}
    finished = {rid for rid, a in answers.items() if isinstance(a, list)}
    dead = {rid for rid, a in answers.items() if isinstance(a, EngineDeadError)}
    assert finished | dead == set(answers) and all(len(answers[rid]) == TOKENS for rid in finished)
    # both engines served before the kill; requests the killed engine held got the error
    assert {picked[rid] for rid in finished_before} == {0, 1}
    assert picked[f"r{killed_at}"] == 1 and f"r{killed_at}" in dead
    # vLLM's monitor marked the client dead and stopped the live engine; later requests were refused
    assert client.resources.engine_dead and llm.errored
    assert procs[1].exitcode == -signal.SIGKILL
    assert wait_until(lambda: procs[0].exitcode is not None, timeout=30)
    assert all(isinstance(answers[f"r{i}"], EngineDeadError) for i in range(REQUESTS - 10, REQUESTS))
    assert wait_until(lambda: reader.status(1) is SlotStatus.STALE, timeout=30)


def test_an_engine_the_server_did_not_start_is_left_by_picks_once_stale(board_name, monkeypatch):
    """No vLLM monitor watches it: the board is what notices it died."""
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    monkeypatch.setenv("DPBOARD_STALE_AFTER", str(STALE_AFTER))
    finished: queue.Queue[tuple[int, list[str]]] = queue.Queue()
    with engines_the_server_did_not_start() as engines:

        def outputs(rank: int, proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                finished.put((rank, json.loads(line)["finished"]))

        for rank, proc in enumerate(engines):
            threading.Thread(target=outputs, args=(rank, proc), daemon=True).start()
        reader = live_reader(board_name, STALE_AFTER)  # as DPBOARD_STALE_AFTER
        with picking_client(vllm_config(2)) as (client, _):
            _left_once_stale(client, engines, finished, reader)


def _left_once_stale(client, engines: list[subprocess.Popen], finished: queue.Queue, reader) -> None:
    """90 requests picked, the second engine SIGKILLed at the 20th; the picks after its slot went stale."""
    done: set[str] = set()
    sent_to: dict[str, int] = {}

    def take_outputs() -> None:  # vLLM's output handler: finished requests leave its bookkeeping
        while not finished.empty():
            rank, ids = finished.get_nowait()
            done.update(ids)
            asyncio.run(DPLBAsyncMPClient.process_engine_outputs(client, EngineCoreOutputs(
                engine_index=rank, finished_requests=set(ids))))

    killed_at = None
    for i in range(REQUESTS):
        take_outputs()
        if i == 20:
            engines[1].send_signal(signal.SIGKILL)
            engines[1].wait(10)
            killed_at = time.monotonic()
        rid = f"r{i}"
        rank = int.from_bytes(client.get_core_engine_for_request(_request(rid)), "little")
        sent_to[rid] = rank
        try:
            engines[rank].stdin.write(json.dumps({"id": rid, "tokens": 32, "max_tokens": 10}) + "\n")
            engines[rank].stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # sent to the dead engine: still in reqs_in_flight under it
        time.sleep(0.02)
    # sent well after the dead engine's slot went stale (its last publish + STALE_AFTER, then a margin)
    after_stale = [rid for rid in sent_to if int(rid[1:]) >= 20 + int(STALE_AFTER / 0.02) + 10]
    assert after_stale and all(sent_to[rid] == 0 for rid in after_stale), sent_to
    assert reader.status(1) is SlotStatus.STALE and time.monotonic() - killed_at > STALE_AFTER
    # every request the live engine got is answered
    assert wait_until(lambda: (take_outputs(), {r for r, k in sent_to.items() if k == 0} <= done)[1], timeout=60)
    dead = {rid for rid, engine in client.reqs_in_flight.items() if engine == (1).to_bytes(2, "little")}
    assert set(sent_to) == done | dead and not done & dead
    assert all(sent_to[rid] == 1 for rid in dead)
    assert all(engine == (1).to_bytes(2, "little") for engine in client.reqs_in_flight.values())


def _request(rid: str):
    from tests.support.vllm_engine import engine_request

    return engine_request(rid, 32, 10)


@pytest.mark.parametrize("way", ["sigterm", "sigkill"])
def test_an_engine_that_leaves_or_is_killed_gets_no_pick_after_the_next_refresh(board_name, monkeypatch, way):
    """An engine asked to stop (SIGTERM: its busy loop ends, then vLLM's teardown takes seconds) says
    so on the board at once; one killed outright loses its slot's lock. With a stale threshold far
    longer than the test, neither is what the stale threshold can catch: the API server's picks leave
    the engine from its first board refresh after the engine stopped reading (a leaving one), or after
    the next look at the slots' locks (a killed one: LOCK_CHECK_INTERVAL). Picks before that are
    counted, as what a request already on its way costs."""
    stale_after = 60.0
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    monkeypatch.setenv("DPBOARD_STALE_AFTER", str(stale_after))
    stopped = threading.Event()
    with engines_the_server_did_not_start() as engines:

        def outputs(proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                if "stopped" in line:
                    stopped.set()

        for proc in engines:
            threading.Thread(target=outputs, args=(proc,), daemon=True).start()
        reader = live_reader(board_name, stale_after)
        with picking_client(vllm_config(2)) as (client, state):
            after = _picks_around_the_engine_gone(client, state.dispatcher, engines, stopped, way)
        picked_after = sum(rank == 1 for rank, _ in after)
        late = sum(rank == 1 for rank, seen in after if seen)
        print(f"{way}: {picked_after} of {len(after)} picks to the gone engine, {late} after it could be seen")
        assert late == 0, after
        assert sum(seen for _, seen in after) >= 30  # most picks came after it could be seen
        assert reader.status(1) is SlotStatus.STALE or way == "sigkill"  # a leaving engine's own word


def _picks_around_the_engine_gone(client, dispatcher, engines: list[subprocess.Popen], stopped: threading.Event,
                                  way: str) -> list[tuple[int, bool]]:
    """Picks until 60 came after the second engine was stopped (``way``) at the 20th: (rank,
    whether the pick's refresh came after the engine was gone and that could be seen)."""
    from dpboard.board.segment import LOCK_CHECK_INTERVAL

    after = []  # (rank, whether the pick's refresh came after the engine was gone and that could be seen)
    gone_at = seen_from = None
    for i in range(200):
        if i == 20:
            if way == "sigterm":
                engines[1].send_signal(signal.SIGTERM)
                assert stopped.wait(30)  # its busy loop has ended: it reads no more requests
            else:
                engines[1].send_signal(signal.SIGKILL)
                engines[1].wait(10)
            gone_at = time.monotonic()
        if gone_at is not None and seen_from is None and time.monotonic() >= gone_at + (
                LOCK_CHECK_INTERVAL if way == "sigkill" else 0):
            seen_from = dispatcher.refresh_count  # refreshes after this one can see it
        rank = int.from_bytes(client.get_core_engine_for_request(_request(f"r{i}")), "little")
        if gone_at is not None:
            after.append((rank, seen_from is not None and dispatcher.refresh_count > seen_from))
        try:
            engines[rank].stdin.write(json.dumps({"id": f"r{i}", "tokens": 32, "max_tokens": 10}) + "\n")
            engines[rank].stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the killed engine's pipe
        if len(after) >= 60:
            break
        time.sleep(0.02)
    return after
