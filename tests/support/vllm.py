"""vLLM's real modules in a process without torch: the import fixture of the vLLM tests, and the
wheels they run on (every release the plugin supports: 0.33.0 beside SGLang's in ``.venv/engines``,
0.32.0 in ``.venv/engines-vllm-0.32.0``; the Makefile's ``VLLM_VERSION`` and ``VLLM_PREVIOUS``).

The stand-ins live in the package (dpboard/bench/vllm_standins.py), because ``dpboard bench`` runs vLLM's
code behind the same ones; this module is the tests' name for them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dpboard.bench.vllm_standins import (
    HOW_TO_GET,
    STAND_INS,
    TORCH_VERSION,
    VLLM_VERSION,
    VLLM_WHEELS,
    install,
    vllm_missing,
)

__all__ = ["HOW_TO_GET", "STAND_INS", "TORCH_VERSION", "VLLM_VERSION", "VLLM_WHEELS", "install", "run_session",
           "vllm_missing", "wheel_env", "wheel_missing", "wheel_params"]


def wheel_params() -> list:
    """The supported wheels as pytest parameters: the newest, then each earlier one marked ``slow``
    (the same tests again: minutes more, run by `make test-all` and CI)."""
    import pytest

    return [v if v == VLLM_VERSION else pytest.param(v, marks=pytest.mark.slow) for v in VLLM_WHEELS]


def wheel_dir(version: str) -> Path | None:
    """The folder the wheel of ``version`` is installed in apart (None: the newest, on the usual path)."""
    return None if version == VLLM_VERSION else Path(sys.prefix) / f"engines-vllm-{version}"


def wheel_env(version: str) -> dict[str, str]:
    """The environment of a process that imports the wheel of ``version``: its folder first on PYTHONPATH,
    ahead of ``.venv/engines`` (which tests/conftest.py puts last)."""
    folder = wheel_dir(version)
    if folder is None:
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)}


def wheel_missing(version: str) -> str | None:
    """Why the wheel of ``version`` cannot run behind the stand-ins (None when it can)."""
    folder = wheel_dir(version)
    if folder is None:
        return vllm_missing()
    how = (f"install it alone: `.venv/bin/pip install --no-deps --target {folder} vllm=={version}` "
           f"(`make test` does it)")
    found = [d.name for d in folder.glob("vllm-*.dist-info")] if folder.is_dir() else []
    if found != [f"vllm-{version}.dist-info"]:
        return f"vLLM {version}'s wheel is not in {folder}: {how}"
    return None



SESSION_TIMEOUT = 1100  # seconds: a session takes 4 to 7 minutes on a loaded 2-core machine


def run_session(folder: str, version: str) -> None:
    """tests/integrations/vllm/FOLDER in a pytest session of its own, on the wheel of ``version``
    (tests/support/wheels.py ``run_own_session``: without the wheel skip, in CI fail)."""
    from tests.support.names import ROOT
    from tests.support.wheels import run_own_session

    run_own_session(ROOT / "tests" / "integrations" / "vllm" / folder, "DPBOARD_VLLM_SESSION", wheel_missing(version),
                    ("DPBOARD_METHOD", "DPBOARD_VLLM_BOARD", "DPBOARD_VLLM", "VLLM_PLUGINS"), ROOT, wheel_env(version),
                    timeout=SESSION_TIMEOUT)
