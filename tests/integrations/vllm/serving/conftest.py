"""The real-serving session: one ``vllm serve --data-parallel-size 2`` with dpboard's plugin, on vLLM's
CPU build and the tiny model (`make test-serving` builds both; tests/support/vllm_serving.py), started
once for the session, since it takes minutes. Its tests run in file order; the last one stops it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.names import new_board_name
from tests.support.vllm_serving import Server, missing

METHOD = "inflight_requests"


@pytest.fixture(scope="session")
def fault_file(tmp_path_factory) -> Path:
    """While this file exists, dpboard's pick raises in the server's API servers."""
    return tmp_path_factory.mktemp("fault") / "raise-in-pick"


@pytest.fixture(scope="session")
def server(fault_file):
    reason = missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the serving tests: {reason}")
        pytest.skip(reason)
    board = new_board_name()
    srv = Server({"DPBOARD_VLLM_BOARD": board, "DPBOARD_METHOD": METHOD, "VLLM_PLUGINS": "dpboard"},
                 fault_file=fault_file)
    srv.board = board
    try:
        srv.ready_after = srv.wait_ready()
        yield srv
    finally:
        srv.kill()
        srv.log_path.unlink(missing_ok=True)
