"""The engine wheels the integration tests import (SGLang's, vLLM's), and the pytest session of its
own that each runs in (their import stand-ins are process-global)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

# tests/conftest.py puts the session's -m expression here, for the sessions it runs of its own
MARKERS_VARIABLE = "DPBOARD_TEST_MARKERS"


def wheel_missing(module: str, version: str, name: str, how_to_get: str) -> str | None:
    """Why ``module`` at ``version`` cannot be imported here (None when it can). find_spec runs no
    package ``__init__``."""
    if importlib.util.find_spec(module) is None:
        return f"{name} is not installed: {how_to_get}"
    found = importlib.metadata.version(module)
    if found != version:
        return f"{name} {found} is installed; these tests are for {version}: {how_to_get}"
    return None


def run_own_session(tests: Path, flag: str, missing: str | None, unset: Iterable[str], cwd: Path,
                    env: dict[str, str] | None = None, timeout: float = 560) -> None:
    """Run ``tests`` in a pytest session of its own (``flag``=1 in its environment lets its conftest
    collect them; ``env`` added to it), for at most ``timeout`` seconds. Without the wheel
    (``missing``) skip, saying why; in CI (CI=true) fail instead."""
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run these tests: {missing}")
        pytest.skip(missing)
    env = {**os.environ, **(env or {}), flag: "1"}
    for key in unset:
        env.pop(key, None)
    # the same selection as the session that runs this one: `make test` leaves its slow tests out
    marks = os.environ.get(MARKERS_VARIABLE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         *(["-m", marks] if marks else []), str(tests)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
    )
    tail = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "failed" not in result.stdout, tail
    # a skip inside is a missing dependency: the check above is the only skip allowed
    assert "skipped" not in result.stdout, tail
