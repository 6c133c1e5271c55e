"""The vLLM plugin against vLLM 0.33.0's real modules, in their own interpreter.

tests/integrations/vllm/real imports vLLM's wheel behind process-global import stand-ins
(tests/support/vllm.py), so it runs as a pytest session of its own. Without the wheel the test
skips and says how to get it; in CI (CI=true) a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import pytest

from tests.support.names import ROOT
from tests.support.vllm import vllm_missing
from tests.support.wheels import run_own_session

pytestmark = pytest.mark.timeout(600)


def test_vllm_session():
    run_own_session(ROOT / "tests" / "integrations" / "vllm" / "real", "DPBOARD_VLLM_SESSION", vllm_missing(),
                    ("DPBOARD_METHOD", "DPBOARD_VLLM_BOARD", "DPBOARD_VLLM", "VLLM_PLUGINS"), ROOT)
