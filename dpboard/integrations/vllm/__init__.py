"""vLLM's engines on a board: a stat-logger plugin (entry-point group ``vllm.stat_logger_plugins``).

- ``settings.py`` — ``VllmBoardSettings`` and ``settings_from_config``: whether the plugin is on, the
  board's name and shape, and each engine's KV capacity, read from a ``VllmConfig`` and the
  environment (no vLLM import).
- ``engines.py`` — ``EngineBoard``: one slot per DP engine, written from plain numbers (running,
  waiting, KV usage, prefix-cache and generation counts); keeps idle engines live (no vLLM import).
- ``stat_logger.py`` — ``DpboardStatLogger``, the class vLLM loads: a thin
  ``AggregateStatLoggerBase`` that hands each engine's ``SchedulerStats`` to ``EngineBoard``. The
  only module that imports vLLM, and only vLLM's loader imports it.

docs/INTEGRATIONS.md says how to run it and what it can and cannot report.
"""
