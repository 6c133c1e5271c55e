"""What the vLLM plugin publishes where, read from a ``VllmConfig`` and the environment.

The plugin is off unless the environment asks for it, because vLLM loads every installed plugin into
every ``vllm serve``: ``DPBOARD_VLLM_BOARD=NAME`` publishes into board NAME, and
``DPBOARD_VLLM=1`` into ``vllm-<served model name>``. ``DPBOARD_VLLM_NODE_ID=K`` stamps node K on
the slots (for ``dpboard relay`` on node K; default 0). ``DPBOARD_VLLM_PUBLISHER`` says who writes
the slots: ``engines`` (the default; engine_core.py) or ``stat_logger`` (stat_logger.py). Both names are stable across the API-server
processes and restarts of one deployment; vLLM's own ``instance_id`` is not (``VllmConfig``
sets it to ``time.time_ns()`` in each process, vllm/config/vllm.py:1513 in 0.33.0).

The config is read by attribute, so this module imports no vLLM. The fields, as vLLM 0.33.0 fills
them in the API-server process (paths in the 0.33.0 wheel):

- ``parallel_config.data_parallel_size`` (config/parallel.py:147): the board's slots, one per
  global DP rank; engine indexes are global ranks (v1/engine/core_client.py:738-747). In an engine
  core of a dense model vLLM resets it to 1 (and ``data_parallel_rank`` to 0): ``engine_slot`` reads
  what vLLM keeps there instead.
- ``parallel_config._api_process_count`` (config/parallel.py:447; set per API server by
  entrypoints/launchers/api_server/entry.py:57): more than one API server splits each engine's steps
  between them (v1/core/sched/scheduler.py:2669-2674 sends a step's stats to one front-end only).
- ``cache_config.kv_cache_size_tokens`` (config/cache.py:344): the KV capacity of one engine, in
  tokens, as vLLM logs it ("KV cache size: N tokens"); group-aware for hybrid models.
- ``cache_config.num_gpu_blocks`` (config/cache.py:333) and ``block_size`` (cache.py:187): the
  fallback capacity. In the API server ``num_gpu_blocks`` is the *sum* over the engines it manages
  (v1/engine/core_client.py:873-877), so one engine's share is that divided by their number.
- ``scheduler_config.max_num_seqs`` (config/scheduler.py:62): the most requests an engine runs.
- ``model_config.served_model_name`` (config/model.py:601): a str after vLLM's normalisation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpboard.board import validate_name
from dpboard.board.stale import stale_after_from
from dpboard.errors import InvalidInputError
from dpboard.methods import LoadBalanceMethod, parse_load_balance_method

ENV_BOARD = "DPBOARD_VLLM_BOARD"
ENV_ENABLE = "DPBOARD_VLLM"
ENV_NODE_ID = "DPBOARD_VLLM_NODE_ID"
ENV_PUBLISHER = "DPBOARD_VLLM_PUBLISHER"
PUBLISHERS = ("engines", "stat_logger")
ENV_METHOD = "DPBOARD_METHOD"
ENV_STALE_AFTER = "DPBOARD_STALE_AFTER"
ENV_PREFIX = "DPBOARD_"  # every setting above starts with it
# vLLM's own, additive list of the prefixes its Ray backend copies to its actors (vllm/ray/ray_env.py)
ENV_RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
# Engine cores publish at every step and every 0.25 s while idle: a second of silence is a stuck or
# dead engine core (or one step longer than that).
DEFAULT_STALE_AFTER = 1.0
DERIVED_PREFIX = "vllm-"
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class VllmBoardSettings:
    """The board one API server publishes into, and what it knows of its engines."""

    board: str
    n_slots: int  # data_parallel_size: one slot per global DP rank
    engine_indexes: tuple[int, ...]  # the global ranks this API server manages
    capacity_tokens: int  # KV capacity of one engine (0: unknown)
    max_running_requests: int  # max_num_seqs
    node_id: int = 0  # stamped on the slots; what `dpboard relay --node-id` forwards


def board_name(environ: Mapping[str, str], served_model_name: str | None) -> str | None:
    """The board's name, or None when the plugin is off."""
    explicit = environ.get(ENV_BOARD, "").strip()
    if explicit:
        try:
            return validate_name(explicit)
        except InvalidInputError as e:
            raise InvalidInputError(f"{ENV_BOARD}: {e}") from None
    if environ.get(ENV_ENABLE, "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    if not served_model_name:
        raise InvalidInputError(f"{ENV_ENABLE}=1 names the board after the served model name, and vLLM "
                                f"reports none: set {ENV_BOARD}=NAME instead")
    return (DERIVED_PREFIX + _NOT_IN_A_NAME.sub("-", served_model_name).strip("-"))[:64]


def publisher(environ: Mapping[str, str] = os.environ) -> str:
    """Who writes the slots: ``engines`` (the default: each engine core, from its scheduler) or
    ``stat_logger`` (the API server, from the stats the engines send it). One of them: both would
    claim the same slots."""
    value = environ.get(ENV_PUBLISHER, "").strip().lower() or PUBLISHERS[0]
    if value not in PUBLISHERS:
        raise InvalidInputError(f"{ENV_PUBLISHER}={value!r}: use one of {', '.join(PUBLISHERS)} "
                                f"(default {PUBLISHERS[0]})")
    return value


def node_id(environ: Mapping[str, str]) -> int:
    raw = environ.get(ENV_NODE_ID, "").strip() or "0"
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidInputError(f"{ENV_NODE_ID}={raw!r} is not a node id: use an integer >= 0 (node0 is 0)")
    return value


def engine_slot(parallel_config: Any) -> tuple[int, int]:
    """An engine core's slot and the board's size: (its global DP rank, the launch's DP size).

    Read in the engine-core process, where vLLM 0.33.0's ``run_engine_core`` (v1/engine/core.py:1552-1562)
    has set ``data_parallel_index`` to the engine's global DP rank on both of its paths (the same number
    as the engine's ``engine_index``, its ZMQ identity, which the API server's ``core_engines`` hold):

    - a MoE model (``DPEngineCoreProc``) keeps ``data_parallel_size`` and ``data_parallel_rank``;
    - a dense model is made an independent DP = 1 engine (``reconfigure_for_independent_dp_rank``,
      config/parallel.py:1191-1200: ``data_parallel_size`` 1, ``data_parallel_rank`` 0). The launch's
      size survives in ``elastic_ep_max_dp_size``: ``ParallelConfig.__post_init__`` set it to
      ``data_parallel_size`` (parallel.py:1036-1040) when the config was built from the command line, and
      the reconfigure leaves it alone. Only elastic EP sets it otherwise (to its maximum), and elastic EP
      needs a MoE model (``enable_eplb``), whose DP fields are kept: there the current size is the size.
    """
    size = int(parallel_config.data_parallel_size)
    if not getattr(parallel_config, "enable_elastic_ep", False):
        launched = getattr(parallel_config, "elastic_ep_max_dp_size", None)
        if isinstance(launched, int) and launched > size:
            size = launched
    rank = getattr(parallel_config, "data_parallel_index", None)
    rank = int(parallel_config.data_parallel_rank if rank is None else rank)
    if not 0 <= rank < size:
        raise InvalidInputError(f"vLLM engine core of DP rank {rank} is outside its data_parallel_size {size}: "
                                f"dpboard reads the DP fields as vLLM 0.33.0 keeps them; run that vLLM "
                                f"(docs/INTEGRATIONS.md, vLLM, \"Dense and MoE models\")")
    return rank, size


def engine_capacity_tokens(cache_config: Any, n_engines: int) -> int:
    """One engine's KV capacity in tokens: vLLM's own per-engine figure when it has one, else the
    engine's share of the summed blocks times the block size; 0 when neither is known."""
    per_engine = getattr(cache_config, "kv_cache_size_tokens", None)
    if isinstance(per_engine, int) and per_engine > 0:
        return per_engine
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    block_size = getattr(cache_config, "block_size", None)
    if isinstance(blocks, int) and isinstance(block_size, int) and blocks > 0 and block_size > 0 and n_engines > 0:
        return blocks // n_engines * block_size
    return 0


def settings_from_config(vllm_config: Any, engine_indexes: Sequence[int],
                         environ: Mapping[str, str] = os.environ) -> VllmBoardSettings | None:
    """The plugin's settings for one API server, or None when the environment leaves it off."""
    name = board_name(environ, getattr(vllm_config.model_config, "served_model_name", None))
    if name is None or publisher(environ) != "stat_logger":
        return None
    parallel = vllm_config.parallel_config
    api_servers = getattr(parallel, "_api_process_count", 1)
    if api_servers > 1:
        raise InvalidInputError(
            f"dpboard's vLLM plugin (board {name!r}) must see every step of its engines, and this vLLM "
            f"runs {api_servers} API servers (vLLM's default with internal load balancing is one per DP "
            f"rank), between which vLLM splits each engine's stats. Run with --api-server-count 1, or "
            f"one `vllm serve --data-parallel-rank R` per rank (external load balancing), or unset "
            f"{ENV_BOARD} and {ENV_ENABLE} to run without the board"
        )
    n_slots = int(parallel.data_parallel_size)
    engines = tuple(int(i) for i in engine_indexes)
    outside = [i for i in engines if not 0 <= i < n_slots]
    if not engines or outside:
        raise InvalidInputError(f"vLLM engine indexes {list(engines)} are not DP ranks of a "
                                f"data_parallel_size {n_slots} deployment")
    return VllmBoardSettings(
        board=name,
        n_slots=n_slots,
        engine_indexes=engines,
        capacity_tokens=engine_capacity_tokens(vllm_config.cache_config, len(engines)),
        max_running_requests=int(getattr(vllm_config.scheduler_config, "max_num_seqs", 0) or 0),
        node_id=node_id(environ),
    )


def carry_to_ray(environ: MutableMapping[str, str] = os.environ) -> None:
    """Add ``DPBOARD_`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` when a DPBOARD_ setting is set.

    With ``--data-parallel-backend ray`` vLLM 0.33.0 starts each engine core as a Ray actor whose
    environment holds only what ``get_env_vars_to_copy`` names (vllm/ray/ray_env.py:55-120; called by
    ``CoreEngineActorManager``, v1/engine/utils.py:533): vLLM's registered variables, those starting with
    ``VLLM_``, ``NCCL_``, ``HF_`` and a few more prefixes, and those starting with a prefix listed in
    this variable (comma-separated, added to vLLM's own). Without it the actors see no DPBOARD_
    setting and publish nothing. The API server runs the plugins while it parses its arguments, before
    it creates the actors, and reads the variable when it creates them (vLLM caches its environment
    only in engine cores and workers), so setting it here is in time. A prefix already listed is kept.
    """
    if not any(name.startswith(ENV_PREFIX) for name in environ):
        return
    listed = [prefix.strip() for prefix in environ.get(ENV_RAY_PREFIXES, "").split(",") if prefix.strip()]
    if ENV_PREFIX not in listed:
        environ[ENV_RAY_PREFIXES] = ",".join([*listed, ENV_PREFIX])


def dispatch_method(environ: Mapping[str, str] = os.environ) -> LoadBalanceMethod | None:
    """DPBOARD_METHOD: the method the API servers pick engines by; None leaves vLLM's own pick."""
    raw = environ.get(ENV_METHOD, "").strip()
    if not raw:
        return None
    try:
        return parse_load_balance_method(raw)
    except InvalidInputError as e:
        raise InvalidInputError(f"{ENV_METHOD}={raw!r}: {e}; unset it to keep vLLM's own pick") from None


def stale_after(environ: Mapping[str, str] = os.environ) -> float:
    return stale_after_from(environ, ENV_STALE_AFTER, DEFAULT_STALE_AFTER)
