"""Step logs: what each scheduler step of an engine computed and how long it took (``DPBOARD_STEP_LOG``).

- ``format.py``: the file (a fixed prelude with the counts, one JSON header line, 72-byte records; 64 in version 1)
- ``settings.py``: ``DPBOARD_STEP_LOG`` and ``DPBOARD_STEP_LOG_MAX_MIB``, checked at the engine's start
- ``writer.py``: ``StepLog``, filled on the scheduler's thread, written by a thread of its own
- ``reader.py``: ``read_step_log``, ``step_log_paths``, ``step_times`` (NumPy; no Numba, no CuPy)
- ``summary.py``: ``dpboard steps FILE_OR_DIR``

The engines' adapters are ``dpboard/integrations/sglang/steps.py`` and ``dpboard/integrations/vllm/steps.py``.
"""
