"""The vLLM session: vLLM 0.33.0's real modules behind the stand-ins of tests/support/vllm.py, and
dpboard's general plugin loaded by vLLM's own loader, once, as every vLLM process loads it."""

from __future__ import annotations

import pytest

from tests.support import vllm as sv

sv.install()

import vllm.plugins as plugins  # noqa: E402
import vllm.v1.engine.core  # noqa: E402,F401  (loaded before the plugins, as in an engine core)

from dpboard.board import SEGMENT_PREFIX, SHM_DIR  # noqa: E402
from dpboard.board.sent import SENT_PREFIX  # noqa: E402
from tests.support.names import new_board_name  # noqa: E402
from tests.support.vllm_engine import vllm_config  # noqa: E402

__all__ = ["vllm_config"]


@pytest.fixture(scope="session", autouse=True)
def loaded_plugins() -> None:
    """vLLM's ``load_general_plugins()`` with VLLM_PLUGINS=dpboard. DPBOARD_METHOD is set while it
    runs so that the API-server patch is registered too; each client reads it again when built."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_PLUGINS", "dpboard")
        env.setenv("DPBOARD_METHOD", "inflight_requests")
        plugins.load_general_plugins()


@pytest.fixture
def board_name(monkeypatch) -> str:
    """A board named by DPBOARD_VLLM_BOARD (the suite's leak check covers it); removed after, with
    its sent record."""
    name = new_board_name()
    monkeypatch.setenv("DPBOARD_VLLM_BOARD", name)
    monkeypatch.delenv("DPBOARD_METHOD", raising=False)
    monkeypatch.delenv("DPBOARD_VLLM", raising=False)
    yield name
    for path in (SHM_DIR / f"{SEGMENT_PREFIX}{name}", SHM_DIR / f"{SENT_PREFIX}{name}"):
        path.unlink(missing_ok=True)
