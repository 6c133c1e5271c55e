"""tests/integrations/sglang/real runs only in a pytest session of its own (test_sglang.py starts
it with DPBOARD_SGLANG_SESSION=1): its SGLang import stand-ins are process-global."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("DPBOARD_SGLANG_SESSION") == "1" else ["real"]
