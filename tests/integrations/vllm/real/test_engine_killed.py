"""An engine core killed mid-stream: its slot goes stale, the API server's picks through the board
leave it, and every request is answered: finished by a live engine, or still in vLLM's
``reqs_in_flight`` under the dead engine, which vLLM's engine-death path answers with an error."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core_client import DPLBAsyncMPClient

from dpboard.board import Board
from dpboard.integrations.vllm import dispatch
from dpboard.snapshot import SlotStatus
from tests.integrations.vllm.real.conftest import vllm_config
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, wait_until
from tests.support.vllm_engine import make_client

pytestmark = pytest.mark.timeout(240)
STALE_AFTER = 1.0
REQUESTS = 90


def test_an_engine_killed_mid_stream_leaves_no_request_unanswered(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    monkeypatch.setenv("DPBOARD_STALE_AFTER", str(STALE_AFTER))
    env = {**os.environ, "VLLM_PLUGINS": "dpboard"}
    engines = [subprocess.Popen([sys.executable, "-m", "tests.support.vllm_engine_proc", str(r), "2"], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for r in range(2)]
    finished: queue.Queue[tuple[int, list[str]]] = queue.Queue()
    state = None
    try:
        for proc in engines:
            assert json.loads(read_line(proc, timeout=120)) == {"ready": True}

        def outputs(rank: int, proc: subprocess.Popen) -> None:
            for line in proc.stdout:
                finished.put((rank, json.loads(line)["finished"]))

        for rank, proc in enumerate(engines):
            threading.Thread(target=outputs, args=(rank, proc), daemon=True).start()
        reader = Board.attach(board_name).reader(stale_after=STALE_AFTER)  # as DPBOARD_STALE_AFTER
        assert wait_until(lambda: all(reader.status(r) is SlotStatus.LIVE for r in range(2)), timeout=30)
        client = make_client(vllm_config(2), 2)
        state = dispatch.client_dispatch(client)
        setattr(client, dispatch.STATE, state)
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
    finally:
        if state is not None:
            state.close()
        for proc in engines:
            kill(proc)


def _request(rid: str):
    from tests.support.vllm_engine import engine_request

    return engine_request(rid, 32, 10)
