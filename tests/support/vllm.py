"""vLLM 0.33.0's real modules in a process without torch: the import fixture of the vLLM tests.

The stand-ins live in the package (dpboard/bench/vllm_standins.py), because ``dpboard bench`` runs vLLM's
code behind the same ones; this module is the tests' name for them.
"""

from __future__ import annotations

from dpboard.bench.vllm_standins import (
    HOW_TO_GET,
    STAND_INS,
    TORCH_VERSION,
    VLLM_VERSION,
    install,
    vllm_missing,
)

__all__ = ["HOW_TO_GET", "STAND_INS", "TORCH_VERSION", "VLLM_VERSION", "install", "vllm_missing"]
