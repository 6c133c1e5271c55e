"""The SGLang plugin and /v1/loads against the real modules of each SGLang release the plugin supports
(0.5.23, 0.5.22), in their own interpreter.

tests/integrations/sglang/real imports SGLang's wheel behind process-global import stand-ins
(tests/support/sglang.py), so it runs as a pytest session of its own, once per release. Without the
wheel the test skips and says how to get it; in CI (CI=true) a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import pytest

from tests.support.sglang import run_session, wheel_params

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("version", wheel_params())
def test_sglang_session(version):
    """Once per release the plugin supports, each on its own wheel (the earlier one marked slow)."""
    run_session(version)
