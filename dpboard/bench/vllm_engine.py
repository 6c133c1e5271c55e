"""vLLM 0.33.0's engine-core scheduler on the CPU, without a model: vLLM's own ``Scheduler``,
``KVCacheManager``, ``KVCacheConfig`` and ``VllmConfig``, built as ``EngineCore.__init__`` builds them
(vllm/v1/engine/core.py:160-229, 320-352), for ``dpboard bench vllm`` and the vLLM tests
(tests/support/vllm_engine.py). Import after ``vllm_standins.load_vllm()``.

Stand-ins, each named (docs/INTEGRATIONS.md lists them with the rest):

- ``ModelConfig``: vLLM's reads a model's files from the Hugging Face hub; this one holds the fields
  the scheduler and the KV capacity read, with a text-only decoder's values.
- ``ModelExecutor``: the GPU workers. Each step's ``ModelRunnerOutput`` is the one a model runner
  makes: no token for a request whose prefill is still chunked, one token (``TOKEN``) for each
  other scheduled request.
- the attention specs' ``state_content_bytes``: the bytes of one head's K and V per token, given as
  a number, because vLLM computes it from the dtype with torch (``get_dtype_size``). The capacity
  is a ratio of these page sizes.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, update_kv_cache_capacity
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

TOKEN = 7  # what the model stand-in samples
HEAD_BYTES = (64 + 64) * 2  # one KV head's K and V of one token, 64-wide, 2-byte dtype


@dataclass
class ModelConfig:
    """Stand-in for vLLM's ModelConfig, which reads a model's files from the Hugging Face hub: the
    fields the plugin, the scheduler and the KV capacity read, for a text-only decoder."""

    served_model_name: str | None = "m"
    max_model_len: int = 4096
    uses_mrope: bool = False
    is_encoder_decoder: bool = False
    runner_type: str = "generate"
    is_diffusion: bool = False
    supports_multimodal_inputs: bool = False
    multimodal_config: Any = None
    skip_tokenizer_init: bool = True
    return_sampling_mask: bool = False



def engine_config(dp: int = 1, rank: int = 0, *, served_model_name: str | None = "m", max_num_seqs: int = 64,
                  max_num_batched_tokens: int = 2048, block_size: int = 16, max_model_len: int = 4096,
                  enable_prefix_caching: bool = True, policy: str = "fcfs") -> VllmConfig:
    """vLLM's own VllmConfig of one engine core (on the CPU device; the model config a stand-in)."""
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(data_parallel_size=dp, data_parallel_rank=rank),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len, is_encoder_decoder=False,
                                         enable_chunked_prefill=True, policy=policy),
    )
    config.model_config = ModelConfig(served_model_name, max_model_len=max_model_len)
    return config


def kv_cache_config(num_blocks: int, block_size: int = 16, *, sliding_window: int | None = None) -> KVCacheConfig:
    """The scheduler's KVCacheConfig: one full-attention group, and with ``sliding_window`` a
    sliding-window group beside it (a hybrid model, both drawing on one block pool of the same page size)."""
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=None,
                             state_content_bytes=HEAD_BYTES)
    groups = [KVCacheGroupSpec(["layers.0.attn"], full)]
    if sliding_window is not None:
        swa = SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=None,
                                state_content_bytes=HEAD_BYTES, sliding_window=sliding_window)
        groups.append(KVCacheGroupSpec(["layers.1.attn"], swa))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_scheduler(config: VllmConfig, kv_config: KVCacheConfig, *, include_finished_set: bool = False) -> Scheduler:
    """vLLM's Scheduler as ``EngineCore.__init__`` builds it once the KV cache is sized: the block
    count and the group-aware capacity into the cache config (``update_kv_cache_capacity``), then
    the scheduler with stats on (as ``vllm serve`` runs it). ``include_finished_set``: each output
    names the requests finished, as under internal DP load balancing (``EngineCoreProc`` passes
    ``internal_dp_balancing``, core.py:1232)."""
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    update_kv_cache_capacity(config, kv_config)
    block_size = config.cache_config.block_size
    return Scheduler(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=block_size,
                     hash_block_size=block_size, include_finished_set=include_finished_set, log_stats=True)


def block_hasher(config: VllmConfig) -> Any:
    """vLLM's request block hasher, as ``EngineCore.__init__`` makes it (core.py:219-229)."""
    if not config.cache_config.enable_prefix_caching:
        return None
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    lookahead = getattr(config, "num_hash_lookahead_tokens", None)  # vLLM 0.33; 0.32 hashes without one
    if lookahead is None:
        return get_request_block_hasher(config.cache_config.block_size, hash_fn)
    return get_request_block_hasher(config.cache_config.block_size, hash_fn, lookahead)


class ModelExecutor:
    """Stand-in for vLLM's executor and its GPU workers: each step's ``ModelRunnerOutput`` as a model
    runner makes it (no token for a chunked prefill's partial step, one for every other request),
    after ``step_seconds`` of the model's time."""

    def __init__(self, scheduler: Scheduler, step_seconds: float = 0.0) -> None:
        self.scheduler = scheduler
        self.step_seconds = step_seconds

    def model_output(self, scheduler_output: Any) -> ModelRunnerOutput:
        ids = list(scheduler_output.num_scheduled_tokens)
        requests = self.scheduler.requests
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                 sampled_token_ids=[[] if requests[rid].is_prefill_chunk else [TOKEN] for rid in ids])

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        output = self.model_output(scheduler_output)
        if not non_block:
            return output
        done: Future = Future()
        done.set_result(output)
        return done

    def sample_tokens(self, grammar_output: Any) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None


def step(scheduler: Scheduler, executor: ModelExecutor | None = None) -> dict[int, EngineCoreOutputs]:
    """One engine step without the engine: ``schedule()``, the model's output, ``update_from_output()``."""
    scheduler_output = scheduler.schedule()
    model_output = (executor or ModelExecutor(scheduler)).model_output(scheduler_output)
    return scheduler.update_from_output(scheduler_output, model_output)
