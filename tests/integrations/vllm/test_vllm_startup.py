"""vLLM's own start-up (tests/integrations/vllm/startup), in a pytest session of its own, as the rest of
the vLLM tests (test_vllm.py): without the wheel the test skips and says how to get it; in CI
(CI=true) a missing wheel is a failure."""

from __future__ import annotations

import pytest

from tests.support.names import ROOT
from tests.support.vllm import vllm_missing
from tests.support.wheels import run_own_session

pytestmark = pytest.mark.timeout(600)


def test_vllm_startup_session():
    run_own_session(ROOT / "tests" / "integrations" / "vllm" / "startup", "DPBOARD_VLLM_SESSION", vllm_missing(),
                    ("DPBOARD_METHOD", "DPBOARD_VLLM_BOARD", "DPBOARD_VLLM", "VLLM_PLUGINS"), ROOT)
