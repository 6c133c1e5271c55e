"""The SGLang plugin and /v1/loads against SGLang 0.5.23's real modules, in their own interpreter.

tests/integrations/sglang/real imports SGLang's wheel behind process-global import stand-ins
(tests/support/sglang.py), so it runs as a pytest session of its own. Without the wheel the test
skips and says how to get it; in CI (CI=true) a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.names import ROOT
from tests.support.sglang import sglang_missing

pytestmark = pytest.mark.timeout(600)


def test_sglang_session():
    reason = sglang_missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SGLang tests: {reason}")
        pytest.skip(reason)
    env = {**os.environ, "DPBOARD_SGLANG_SESSION": "1"}
    env.pop("DPBOARD_METHOD", None)
    env.pop("DPBOARD_BOARD", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(ROOT / "tests" / "integrations" / "sglang" / "real")],
        capture_output=True, text=True, timeout=560, env=env, cwd=ROOT,
    )
    tail = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "failed" not in result.stdout, tail
    # a skip inside is a missing dependency: this session's own check above is the only skip allowed
    assert "skipped" not in result.stdout, tail
