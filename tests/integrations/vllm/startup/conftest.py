"""The vLLM start-up session: deployments started by vLLM's own start-up code, each in processes of
its own (tests/support/vllm_startup.py), and vLLM's Ray environment. A session apart from
tests/integrations/vllm/real (tests/integrations/vllm/test_vllm_startup.py starts it): these start
dozens of vLLM processes, and the stand-ins of tests/support/vllm.py are process-global."""

from __future__ import annotations

from tests.integrations.vllm.real.conftest import board_name

__all__ = ["board_name"]
