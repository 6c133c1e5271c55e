"""The vLLM plugin against vLLM 0.33.0's real modules, in their own interpreter.

tests/integrations/vllm/real imports vLLM's wheel behind process-global import stand-ins
(tests/support/vllm.py), so it runs as a pytest session of its own. Without the wheel the test
skips and says how to get it; in CI (CI=true) a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.names import ROOT
from tests.support.vllm import vllm_missing

pytestmark = pytest.mark.timeout(600)


def test_vllm_session():
    reason = vllm_missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the vLLM tests: {reason}")
        pytest.skip(reason)
    env = {**os.environ, "DPBOARD_VLLM_SESSION": "1"}
    for key in ("DPBOARD_METHOD", "DPBOARD_VLLM_BOARD", "DPBOARD_VLLM", "VLLM_PLUGINS"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(ROOT / "tests" / "integrations" / "vllm" / "real")],
        capture_output=True, text=True, timeout=560, env=env, cwd=ROOT,
    )
    tail = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "failed" not in result.stdout, tail
    assert "skipped" not in result.stdout, tail
