# Llama-3.1-8B-Instruct in BF16 on one H100 80 GB per DP rank (TP 1), SGLang's defaults.
#
# Model: 32 layers, 8 KV heads x 128, so 2*32*8*128*2 B = 128 KiB of KV per token; 16.06 GB of
# weights; about 15 GFLOP per token.
#
# kv_capacity_tokens: SGLang's default mem_fraction_static on an 80 GB GPU is about 0.835
#   (ServerArgs._handle_gpu_memory_settings: reserved = 512 MB + 1.5 x chunked_prefill_size MB +
#   2 x cuda_graph_max_bs MB + 1 GB); 0.835 x 79.6 GiB - 15 GiB of weights = 51.5 GiB
#   = 420k tokens of 128 KiB.
# max_running_requests: SGLang's default, min(max_total_num_tokens // 2, req_to_token pool size),
#   the pool clamped to 2048..4096 rows: 2048 for this model.
# chunked_prefill_size: SGLang's default for GPUs of 60-160 GB (8192).
# prefill_token_us: TensorRT-LLM's published max-throughput table (docs/source/performance/
#   perf-overview.md, "Llama 3.1 8B", FP8, H100 TP1) gives 3,450 output tok/s at ISL/OSL
#   2048/128, i.e. at least 55.2k prompt tok/s in FP8; BF16 GEMMs are 1.6-2x slower, so
#   28-35k prompt tok/s in BF16; the FLOP roofline (15 GFLOP/token at 50 % of 989 TFLOPS) gives
#   34k. 32 us per token = 31k tok/s.
# decode_step_ms: vLLM's nightly benchmark (buildkite vllm/performance-benchmark build 9515,
#   latency_llama8B_tp1, H200) measured 833 ms for 128 output tokens at batch 8: 6.5 ms per step
#   with a small batch. An H100 reads the 16 GB of weights more slowly (5.6 ms at 85 % of
#   3.35 TB/s), so 6.5 ms is a floor, not an overestimate. prefill_step_ms: the same weight read.
# decode_request_us: 15 GFLOP per sequence at 60 % of 989 TFLOPS = 25 us.
# decode_kv_token_ns: reading 128 KiB per KV token at 80 % of 3.35 TB/s = 49 ns.
#   Check: 256 sequences of 1k tokens -> 6.5 + 6.4 + 12.5 = 25 ms per step, 10k output tok/s.
# slo_ttft_ms, slo_tpot_ms (goodput): an interactive chat's 1 s to the first token and 100 ms per
#   token after it (about reading speed); chosen, not measured.
name = llama3.1-8b-h100
description = Llama-3.1-8B-Instruct BF16, one H100 80 GB per rank (TP 1), SGLang defaults
source = TensorRT-LLM perf-overview.md (Llama 3.1 8B, H100); vLLM nightly benchmark build 9515 (latency_llama8B_tp1); SGLang server_args defaults; roofline arithmetic (see the comments)
kv_capacity_tokens = 420000
max_running_requests = 2048
chunked_prefill_size = 8192
prefill_step_ms = 6.5
prefill_token_us = 32
decode_step_ms = 6.5
decode_request_us = 25
decode_kv_token_ns = 49
slo_ttft_ms = 1000
slo_tpot_ms = 100
