"""Engines at the edge: each subpackage adapts one engine to the board and imports that engine
lazily, only inside itself (``sglang/``: the SGLang plugin; ``vllm/``: the vLLM stat logger)."""
