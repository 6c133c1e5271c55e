"""tests/integrations/vllm/real and tests/integrations/vllm/startup run only in pytest sessions of their
own (test_vllm.py and test_vllm_startup.py start them with DPBOARD_VLLM_SESSION=1): their vLLM import
stand-ins (tests/support/vllm.py) are process-global. tests/integrations/vllm/serving runs only in the
environment `make test-serving` builds (vLLM's CPU build; it sets DPBOARD_VLLM_SERVING=1)."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("DPBOARD_VLLM_SESSION") == "1" else ["real", "startup"]
if os.environ.get("DPBOARD_VLLM_SERVING") != "1":
    collect_ignore.append("serving")
