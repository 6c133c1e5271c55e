"""vLLM's engines on a board, both ways (docs/INTEGRATIONS.md, vLLM).

- ``plugin.py`` — ``register()``, the ``vllm.general_plugins`` entry point vLLM runs in every
  process: it patches the engine core's class, and with ``DPBOARD_METHOD`` the API server's
  load-balancing client, in whichever process loads them.
- ``engine_core.py`` — ``EnginePublisher``: each engine core publishes its scheduler's load and the
  requests it took in into its rank's slot, at every step, and keeps an idle engine live.
- ``dispatch.py`` — ``ClientDispatch``: ``DPLBAsyncMPClient.get_core_engine_for_request`` picks
  through dpboard's ``Dispatcher``, keeping vLLM's routing rules, with every API server's in-flight
  requests from the sent record beside the board (``dpboard.board.sent``).
- ``versions.py`` — the vLLM releases supported (0.32.x, 0.33.x) and the names of vLLM's each hook
  uses there; on another release, or with a name missing, a process says so in one line and leaves
  vLLM's code as it is.
- ``leaving.py`` — nothing of the board outlives the deployment: the last process out, and the
  ``vllm serve`` launcher at its exit, remove the board and its records that no live process holds.
- ``settings.py`` — what the environment asks for (board, method, publisher, node id) and what a
  ``VllmConfig`` says, read by attribute (no vLLM import).
- ``stat_logger.py`` and ``engines.py`` — the other publisher (``DPBOARD_VLLM_PUBLISHER=stat_logger``):
  a ``vllm.stat_logger_plugins`` class in the API server, republishing the stats engines send it.

Only ``stat_logger.py`` imports vLLM at module level; the others reach vLLM's classes through the
modules vLLM itself loaded.
"""
