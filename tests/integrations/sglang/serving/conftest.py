"""The SGLang serving session: one unchanged ``sglang.launch_server --dp-size 2 --load-balance-method
total_tokens`` with dpboard's plugin (``SGLANG_PLUGINS=dpboard``, ``DPBOARD_METHOD``) on the CPU and the
tiny model (`make test-sglang-serving` builds both; tests/support/sglang_serving.py), started once
for the session. Its tests run in file order; the last one stops it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from dpboard.board import SHM_DIR
from tests.integrations.serving_faults import fault_file, need_environment
from tests.support.names import new_board_name
from tests.support.procutil import wait_until
from tests.support.session_server import ready_server
from tests.support.sglang_serving import Server, missing

METHOD = "inflight_tokens"
__all__ = ["fault_file"]  # the session's fixture: while its file exists, dpboard's pick raises


def plugin_env(board: str, method: str = METHOD) -> dict[str, str]:
    return {"SGLANG_PLUGINS": "dpboard", "DPBOARD_BOARD": board, "DPBOARD_METHOD": method}


def start(env: dict[str, str], **kwargs) -> Server:
    need_environment(missing(kwargs.get("dp_attention", False)), "the SGLang serving tests")
    return ready_server(lambda: Server(env, **kwargs))


@contextmanager
def serving(method: str = METHOD, env: dict[str, str] | None = None, **kwargs) -> Iterator[Server]:
    """A server with the plugin dispatching by ``method`` on a board of its own (``srv.board``), with
    SGLang's load-aware ``--load-balance-method total_tokens``; ``env`` beside the plugin's; stopped
    at the end."""
    board = new_board_name()
    srv = start({**plugin_env(board, method), **(env or {})}, extra=("--load-balance-method", "total_tokens"),
                **kwargs)
    srv.board = board
    try:
        yield srv
    finally:
        stop(srv)


@pytest.fixture(scope="session")
def server(fault_file):
    with serving(fault_file=fault_file) as srv:
        yield srv


def stop(srv: Server) -> None:
    """Whatever still runs of the server, SIGKILLed; then the plugin's watcher removes its board
    (the session's leak check comes right after)."""
    srv.kill()
    wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{srv.board}")), timeout=60)
    srv.log_path.unlink(missing_ok=True)
