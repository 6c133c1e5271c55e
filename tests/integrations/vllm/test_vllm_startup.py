"""vLLM's own start-up (tests/integrations/vllm/startup), in a pytest session of its own, as the rest of
the vLLM tests (test_vllm.py): without the wheel the test skips and says how to get it; in CI
(CI=true) a missing wheel is a failure."""

from __future__ import annotations

import pytest

from tests.support.vllm import run_session, wheel_params

pytestmark = pytest.mark.timeout(1200)  # a session takes 4 to 7 minutes on a loaded 2-core machine


@pytest.mark.parametrize("version", wheel_params())
def test_vllm_startup_session(version):
    """Once per release the plugin supports, each on its own wheel (the earlier one marked slow)."""
    run_session("startup", version)
