"""SGLang's previous release (0.5.22), unchanged, serving with dpboard inside: ``sglang.launch_server
--dp-size 2 --load-balance-method total_tokens`` on the CPU with ``DPBOARD_METHOD``, as test_serving.py
runs 0.5.23, in the same environment. 0.5.22's wheel is installed alone (``--no-deps``) in a folder of
that environment (``.venv-sglang/sglang-0.5.22``, the Makefile's ``SGLANG_PREVIOUS``) put first on the
server's PYTHONPATH: every other package is the one 0.5.23 runs on (docs/INTEGRATIONS.md, "A real
SGLang server on the CPU", says which requirements of 0.5.22's differ and why that holds).

A server of its own, started for this module: it starts, its two schedulers publish LIVE slots,
requests are dispatched by dpboard to both ranks and counted there, and SIGTERM to its process group
leaves nothing in /dev/shm."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.snapshot import SlotStatus
from tests.integrations.serving_faults import counted, counted_by_then, need_environment
from tests.integrations.sglang.serving.conftest import METHOD, serving
from tests.support.names import SESSION_FILES
from tests.support.procutil import wait_until
from tests.support.sglang import SGLANG_PREVIOUS
from tests.support.sglang_serving import KV_TOKENS, SGLANG_VENV

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1200)]
DP = 2
SETTLE = 120.0
FOLDER = SGLANG_VENV / f"sglang-{SGLANG_PREVIOUS}"  # the Makefile's SGLANG_PREVIOUS_SERVING


def records(server) -> np.ndarray:
    with Board.attach(server.board) as board:
        return board.reader().read_array().copy()


def live(server) -> bool:
    return bool((records(server)["status"] == int(SlotStatus.LIVE)).all())


@pytest.fixture(scope="module")
def server():
    found = sorted(d.name for d in FOLDER.glob("sglang-*.dist-info")) if FOLDER.is_dir() else []
    need_environment(None if found == [f"sglang-{SGLANG_PREVIOUS}.dist-info"] else
                     f"SGLang {SGLANG_PREVIOUS} is not alone in {FOLDER}: run `make test-sglang-serving`",
                     "the SGLang serving tests")
    with serving(env={"PYTHONPATH": str(FOLDER)}) as srv:
        yield srv


def test_the_server_runs_sglang_0_5_22_with_two_live_slots(server):
    status, info = server.get("/server_info")
    assert status == 200 and info["version"] == SGLANG_PREVIOUS, info
    schedulers = server.schedulers(DP)
    assert [len(p) for p in schedulers] == [1, 1], (schedulers, server.tail())
    assert wait_until(lambda: live(server), timeout=60), records(server)
    r = records(server)
    assert r["writer_pid"].tolist() == [p[0] for p in schedulers]
    assert r["max_total_num_tokens"].tolist() == [KV_TOKENS, KV_TOKENS]
    assert f"dpboard: SGLang's loads are on board '{server.board}' (2 ranks)" in server.log()
    assert f"dpboard: DP dispatch by {METHOD} over board '{server.board}' (2 worker slots)" in server.log()
    assert "steps aside" not in server.log()


def test_requests_dispatched_by_dpboard_to_both_ranks(server):
    """Four requests at once: dpboard's pick (in-flight tokens, each charged as it is sent) sends them
    to both ranks; each answer says the rank that served it, and the board counts what each rank took
    in; the dispatch record counts them."""
    assert wait_until(lambda: live(server), timeout=SETTLE), records(server)
    before = records(server)["num_received_reqs"].astype(np.int64)
    requests = counted(server, "requests")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: server.generate(f"the previous release, request {i}", 16), range(4)))
    for status, answer in answers:
        assert status == 200, answer
    served = Counter(answer["meta_info"]["dp_rank"] for _, answer in answers)
    assert sorted(served) == [0, 1], (served, server.tail())
    expected = [served[rank] for rank in range(DP)]
    assert wait_until(lambda: (records(server)["num_received_reqs"] - before).tolist() == expected,
                      timeout=SETTLE), (records(server), expected)
    counted_by_then(server, "requests", requests + 4, server.generate, settle=SETTLE)
    assert live(server)


def test_sigterm_leaves_nothing_in_dev_shm(server):
    """The last test: SIGTERM to the server's process group; the plugin's watcher removes the board and
    the dispatch record after SGLang has SIGKILLed its tree."""
    files = sorted(p.name for kind in SESSION_FILES for p in SHM_DIR.glob(f"{kind}{server.board}"))
    assert files == [f"dpboard-dispatch.{server.board}", f"dpboard.{server.board}"], files
    took = server.stop()
    assert server.pids() == [], server.tail()
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{server.board}")), timeout=60), \
        (sorted(SHM_DIR.glob(f"dpboard*{server.board}")), server.tail())
    assert took < 120
    assert f"after SGLang server {server.proc.pid} ended" in server.log()
