"""The SGLang plugin and /v1/loads against SGLang 0.5.23's real modules, in their own interpreter.

tests/integrations/sglang/real imports SGLang's wheel behind process-global import stand-ins
(tests/support/sglang.py), so it runs as a pytest session of its own. Without the wheel the test
skips and says how to get it; in CI (CI=true) a missing wheel is a failure, not a skip.
"""

from __future__ import annotations

import pytest

from tests.support.names import ROOT
from tests.support.sglang import sglang_missing
from tests.support.wheels import run_own_session

pytestmark = pytest.mark.timeout(600)


def test_sglang_session():
    run_own_session(ROOT / "tests" / "integrations" / "sglang" / "real", "DPBOARD_SGLANG_SESSION", sglang_missing(),
                    ("DPBOARD_METHOD", "DPBOARD_BOARD"), ROOT)
