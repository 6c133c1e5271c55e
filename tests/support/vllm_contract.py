"""vLLM 0.33.0's stat-logger plugin contract, re-declared: what dpboard's plugin uses of vLLM and how
vLLM calls it, nothing more. Each piece names the file and lines of the vLLM 0.33.0 wheel (commit
4ba787ec9, vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl) it pins.

vLLM itself is not installed in the test environment (a 340 MB wheel that pulls a CUDA build of
torch); ``install()`` puts these declarations under vLLM's module names in ``sys.modules`` of a
process of its own (tests/support/vllm_host.py), and the loader below finds dpboard's plugin the way
vLLM does, through ``importlib.metadata`` and the entry point the installed package declares.
"""

from __future__ import annotations

import os
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

VLLM_VERSION = "0.33.0"
STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"  # vllm/plugins/__init__.py:24-26


# -- vllm/v1/metrics/loggers.py -----------------------------------------------------------------


class StatLoggerBase(ABC):  # loggers.py:54-81
    @abstractmethod
    def __init__(self, vllm_config: Any, engine_index: int = 0): ...  # :62-63

    @abstractmethod
    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0): ...  # :65-72

    @abstractmethod
    def log_engine_initialized(self): ...  # :74-75

    def log(self):  # noqa: B027 - :77-78, optional (vLLM gives it no body either)
        pass

    def record_sleep_state(self, is_awake: int, level: int):  # noqa: B027 - :80-81, optional
        pass


class AggregateStatLoggerBase(StatLoggerBase):  # loggers.py:101-109
    @abstractmethod
    def __init__(self, vllm_config: Any, engine_indexes: list[int]): ...  # :105-106

    def record_admission_rejection(self, reason: str) -> None:  # :108-109
        pass


LOAD_FAILURES: list[tuple[str, str]] = []  # (entry point, error) that vLLM would only log


def load_stat_logger_plugin_factories(environ: dict[str, str] | None = None) -> list[tuple[str, type]]:
    """vLLM's discovery: every entry point of the group, or only those named in VLLM_PLUGINS when it
    is set (plugins/__init__.py:40, 64-72; envs.py:1170-1174), loaded (an entry point that fails to
    load is logged and skipped), then checked to be a StatLoggerBase subclass or refused with
    TypeError (loggers.py:84-98)."""
    environ = os.environ if environ is None else environ
    allowed = environ["VLLM_PLUGINS"].split(",") if "VLLM_PLUGINS" in environ else None
    factories = []
    for plugin in entry_points(group=STAT_LOGGER_PLUGINS_GROUP):
        if allowed is not None and plugin.name not in allowed:
            continue
        try:
            plugin_class = plugin.load()
        except Exception as e:
            LOAD_FAILURES.append((plugin.name, f"{type(e).__name__}: {e}"))
            continue
        if not isinstance(plugin_class, type) or not issubclass(plugin_class, StatLoggerBase):
            raise TypeError(f"Stat logger plugin {plugin.name!r} must be a subclass of StatLoggerBase "
                            f"(got {plugin_class!r}).")
        factories.append((plugin.name, plugin_class))
    return factories


def build_stat_logger(factory: type, vllm_config: Any, engine_indexes: list[int]) -> StatLoggerBase:
    """StatLoggerManager.__init__ (loggers.py:1395-1414): an aggregate logger is built once with
    keyword arguments; a per-engine one would be built per engine, positionally (loggers.py:442-445)."""
    if not issubclass(factory, AggregateStatLoggerBase):
        raise AssertionError(f"{factory!r} is a per-engine logger; dpboard's is an aggregate one")
    return factory(vllm_config=vllm_config, engine_indexes=engine_indexes)


# -- vllm/v1/metrics/stats.py -------------------------------------------------------------------


@dataclass
class PrefixCacheStats:  # stats.py:22-36 (BaseCacheStats) and 120-135; queries and hits are tokens
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass
class SchedulerStats:  # stats.py:222-245, the fields up to prefix_cache_stats, in order
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: Any = None
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)


class IterationStats:  # stats.py:474-483, the one field the plugin reads
    def __init__(self, num_generation_tokens: int = 0) -> None:
        self.num_generation_tokens = num_generation_tokens


# -- vllm/config -------------------------------------------------------------------------------


@dataclass
class CacheConfig:  # config/cache.py:187, 333, 344 (as the API server holds them after the handshake)
    block_size: int = 16
    num_gpu_blocks: int | None = None  # summed over the managed engines (v1/engine/core_client.py:873-877)
    kv_cache_size_tokens: int | None = None  # per engine (core_client.py:884-889)


@dataclass
class ParallelConfig:  # config/parallel.py:147, 447
    data_parallel_size: int = 1
    _api_process_count: int = 1


@dataclass
class SchedulerConfig:  # config/scheduler.py:62
    max_num_seqs: int = 128


@dataclass
class ModelConfig:  # config/model.py:329, 601
    served_model_name: str | None = None


@dataclass
class VllmConfig:  # config/vllm.py:349
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)


def install() -> None:
    """Registers these declarations as vLLM's modules in this process (vLLM must not be importable)."""
    modules = {
        "vllm": {"__version__": VLLM_VERSION},
        "vllm.config": {"VllmConfig": VllmConfig},
        "vllm.v1": {},
        "vllm.v1.metrics": {},
        "vllm.v1.metrics.loggers": {
            "StatLoggerBase": StatLoggerBase,
            "AggregateStatLoggerBase": AggregateStatLoggerBase,
            "load_stat_logger_plugin_factories": load_stat_logger_plugin_factories,
        },
        "vllm.v1.metrics.stats": {"SchedulerStats": SchedulerStats, "IterationStats": IterationStats,
                                  "PrefixCacheStats": PrefixCacheStats},
    }
    for name, attrs in modules.items():
        if name in sys.modules:
            raise AssertionError(f"{name} is already imported: the stand-in needs a process without vLLM")
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        if name != "vllm":
            module.__path__ = []  # a package, so that its submodules resolve
        sys.modules[name] = module
    sys.modules["vllm"].__path__ = []
