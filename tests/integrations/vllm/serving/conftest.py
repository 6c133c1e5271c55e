"""The real-serving session: one ``vllm serve --data-parallel-size 2`` with dpboard's plugin, on vLLM's
CPU build and the tiny model (`make test-serving` builds both; tests/support/vllm_serving.py), started
once for the session, since it takes minutes. Its tests run in file order; the last one stops it."""

from __future__ import annotations

import pytest

from tests.integrations.serving_faults import fault_file, need_environment
from tests.support.names import new_board_name
from tests.support.session_server import ready_server
from tests.support.vllm_serving import Server, missing

METHOD = "inflight_requests"
__all__ = ["fault_file"]  # the session's fixture: while its file exists, dpboard's pick raises


@pytest.fixture(scope="session")
def server(fault_file):
    need_environment(missing(), "the serving tests")
    board = new_board_name()
    srv = ready_server(lambda: Server({"DPBOARD_VLLM_BOARD": board, "DPBOARD_METHOD": METHOD,
                                       "VLLM_PLUGINS": "dpboard"}, fault_file=fault_file))
    srv.board = board
    try:
        yield srv
    finally:
        srv.kill()
        srv.log_path.unlink(missing_ok=True)
