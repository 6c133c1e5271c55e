"""tests/integrations/vllm/real runs only in a pytest session of its own (test_vllm.py starts it with
DPBOARD_VLLM_SESSION=1): its vLLM import stand-ins (tests/support/vllm.py) are process-global."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("DPBOARD_VLLM_SESSION") == "1" else ["real"]
