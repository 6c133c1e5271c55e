"""The vLLM plugin against the real modules of each vLLM release it supports (0.33.0, 0.32.0), in their
own interpreter.

tests/integrations/vllm/real imports vLLM's wheel behind process-global import stand-ins
(tests/support/vllm.py), so it runs as a pytest session of its own. Without the wheel the test
skips and says how to get it; in CI (CI=true) a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import pytest

from tests.support.vllm import run_session, wheel_params

pytestmark = pytest.mark.timeout(1200)  # a session takes 4 to 7 minutes on a loaded 2-core machine


@pytest.mark.parametrize("version", wheel_params())
def test_vllm_session(version):
    """Once per release the plugin supports, each on its own wheel (the earlier one marked slow)."""
    run_session("real", version)
