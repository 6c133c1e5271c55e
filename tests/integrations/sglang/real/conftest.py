"""The SGLang session: the real modules of one SGLang release the plugin supports (DPBOARD_SGLANG_WHEEL:
0.5.23 or 0.5.22) behind the stand-ins of tests/support/sglang.py, and the dpboard plugin loaded by
SGLang's own plugin loader, once, as a server process loads it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from tests.support import sglang as sgl

sgl.install()

import sglang.srt.managers.data_parallel_controller as dpc  # noqa: E402  (loaded before the plugins, as in SGLang's DP controller)
import sglang.srt.managers.load_snapshot as ls  # noqa: E402
import sglang.srt.plugins as plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from dpboard.integrations.sglang import transport  # noqa: E402
from tests.support.names import new_board_name  # noqa: E402


@pytest.fixture(scope="session")
def loaded_plugins() -> set[str]:
    """SGLang's ``load_plugins()`` with SGLANG_PLUGINS=dpboard, as every SGLang process runs it;
    DPBOARD_METHOD is set while it runs, to a method that holds, so that every DP controller hook is
    registered (they read it again when a controller is made). Returns the targets HookRegistry
    patched."""
    saved = {key: os.environ.get(key) for key in ("SGLANG_PLUGINS", "DPBOARD_METHOD")}
    os.environ.update(SGLANG_PLUGINS="dpboard", DPBOARD_METHOD="inflight_wave")
    try:
        plugins.load_plugins()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return set(HookRegistry._patched)


@dataclass
class Instance:
    """One SGLang instance of a test: its port args and the board name the plugin will use."""

    board: str
    port_args: sgl.PortArgs
    dp_size: int
    made: list = field(default_factory=list)


@pytest.fixture
def instance(loaded_plugins, monkeypatch) -> Instance:
    """An SGLang instance with 3 DP ranks (SHM mode), its board named by DPBOARD_BOARD (so that the
    suite's leak check covers it); every board the plugin opened in this process is removed after."""
    name = new_board_name()
    monkeypatch.setenv("DPBOARD_BOARD", name)
    monkeypatch.delenv("DPBOARD_METHOD", raising=False)
    monkeypatch.delenv("DPBOARD_STALE_AFTER", raising=False)
    monkeypatch.delenv("SGLANG_LOAD_SNAPSHOT_USE_ZMQ", raising=False)
    sgl.set_context(dp_size=3)
    yield Instance(name, sgl.PortArgs(instance_id=name.replace("-", "x")), 3)
    drop_boards()
    sgl.reset_context()


def drop_boards() -> None:
    """Close the boards the plugin opened in this process, removing those it created."""
    for board in list(transport._boards.values()):
        board.close()
        if board.is_owner:
            board.unlink()
    transport._boards.clear()


__all__ = ["Instance", "dpc", "drop_boards", "ls"]
