# DeepSeek-V3/R1 (671B MoE, FP8 weights) served by SGLang with DP attention and expert parallelism
# on H100s: one DP rank per GPU. Per-rank figures from the LMSYS blog "Deploying DeepSeek with PD
# Disaggregation and Large-scale Expert Parallelism on 96 H100 GPUs" (2025-05-05,
# https://lmsys.org/blog/2025-05-05-large-scale-ep/), divided by the 8 GPUs of a node.
#
# prefill_token_us: "per-node throughputs of 57,674, 54,543, and 50,302 tokens per second for
#   prompt lengths of 1K, 2K, and 4K": 54,543 / 8 = 6.8k prompt tokens per second per rank at 2K.
# chunked_prefill_size: "16,384 tokens per device" per prefill forward (the blog's profile run; a
#   reproduction in sgl-project/sglang#6017 runs --chunked-prefill-size 131072 with --dp-size 8,
#   i.e. 16,384 per rank).
# decode: "22,282 tokens/sec per node for 2K inputs" at 256 requests per GPU with ~2,000 KV tokens
#   each: 2,785 tok/s per rank = a 92 ms step at batch 256 (the blog reports ITL of about 100 ms).
#   One measured point only, so the split into a + b*B + c*KV is an assumption: c = 30 ns (MLA
#   caches 70,272 B per token, read at ~2.3 TB/s: 16 ms for 525k tokens), b = 0.1 ms per request,
#   a = 92 - 16 - 26 = 50 ms (expert GEMMs and the DeepEP all-to-alls, mostly batch-blind). A
#   prefill step pays the same 50 ms floor.
# max_running_requests: the blog's decode runs at batch 256 per GPU (--cuda-graph-bs 256).
# kv_capacity_tokens: 256 requests x 2,000 tokens = 512k sat at the ceiling in the blog's decode
#   run; the memory left after ~30 GB of per-rank weights is 31-38 GB = 0.45-0.55M MLA tokens.
#
# DP attention (dp_attention = 1): the ranks step in lockstep (dpboard/sim/stepping.py). What a
# step shares across the group is the routed experts, which expert parallelism spreads over it.
# Their part of the per-token cost comes from DeepSeek-V3's published shapes (config.json of
# deepseek-ai/DeepSeek-V3: hidden 7168, 61 layers of which 3 dense (FFN 18432) and 58 MoE with 8 of
# 256 routed experts and 1 shared expert of 2048, MLA with q_lora 1536, kv_lora 512, 128 heads):
# weights touched per token = routed 20.4B + shared 2.6B + dense FFN 1.2B + MLA 11.4B + head 0.9B
# = 36.6B (DeepSeek's "37B activated"), so the routed experts are 55.8 % of a token's matmuls.
# moe_prefill_token_us: the blog's per-node prefill figures fall with the prompt length (8 GPUs /
#   57,674, 54,543, 50,302 tok/s = 138.7, 146.7, 159.0 us per token at 1K, 2K, 4K): 6.6 ns per
#   token of context is attention; the rest at 2K, 133 us, is matmuls, 55.8 % of it routed: 74 us.
# moe_decode_token_us: 55.8 % of decode_request_us (the batch-proportional part): 56 us. The step
#   floor (decode_step_ms, prefill_step_ms) is shared: DeepEP's all-to-all latency and the expert
#   weight reads happen once per step whatever the split.
# eager_decode_ms: no published figure. SGLang runs a decode without its CUDA graph when any rank
#   extends (can_run_decode_cuda_graph is the min over ranks); 61 layers x ~20 kernels launched at
#   ~10 us each is ~12 ms: an estimate, not a measurement.
# deepep_normal_ms: no published figure. SGLang's DeepEP auto mode runs every rank's MoE all-to-all
#   in normal mode in a step where any rank extends (DeepEPMode.resolve in
#   sglang/srt/layers/moe/utils.py), in low-latency mode otherwise. Normal mode's dispatch waits on
#   the host for the count of tokens each rank receives and exchanges the counts first (DeepEP's
#   docs: "the CPU will wait for GPU's signal to arrive"), which low-latency mode does not: 58 MoE
#   layers x ~100 us is ~6 ms per such step: an estimate, not a measurement. The blog's prefill
#   figures (normal mode throughout) carry its bandwidth part already.
# idle_pass_ms: no published figure. A pass of SGLang's scheduler loop in which the prefill
#   delayer held the only work there was runs no forward: the delayer's all-gather and the batch
#   sync's over the group on the CPU (gloo), and a loop turn; ~1 ms is an estimate, not a
#   measurement (the sensitivity cells rerun it at 0.25 and 4 ms).
# server_chunked_prefill_size: SGLang's --chunked-prefill-size default on an 80 GB H100 (8,192,
#   _handle_gpu_memory_settings in sglang/srt/arg_groups/memory_hook.py). Under colocated DP
#   attention SGLang divides it by the attention-DP size (parallel_hook.py): 512 per rank on 16
#   ranks. chunked_prefill_size (16,384 per rank) is the blog's PD prefill setting, kept for
#   independent ranks and PD pools.
# slo_tpot_ms: the blog's ITL of "about 100 ms" at its decode operating point; slo_ttft_ms: the top
#   of the 2-5 s TTFT it lists among its limitations. A request meets both when it is served at
#   least as well as the blog's deployment served it.
# PD (--pd P:D): kv_bytes_per_token: MLA caches 61 layers x (512 + 64) x 2 B = 70,272 B per token.
#   kv_link_gbps: the blog's nodes give each H100 its own 400 Gb/s InfiniBand NIC (50 GB/s); 40 GB/s
#   is 80 % of it. kv_transfer_ms, bootstrap_rtt_ms: a transfer's setup and one HTTP round trip to
#   the bootstrap server, about a millisecond or two on a LAN: estimates, not measurements.
name = deepseek-v3-dp-attention-h100
description = DeepSeek-V3 FP8, SGLang DP attention + EP, one H100 per DP rank
source = LMSYS blog 2025-05-05 "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 GPUs" (per node / 8); sgl-project/sglang#6017
kv_capacity_tokens = 500000
max_running_requests = 256
chunked_prefill_size = 16384
prefill_step_ms = 50
prefill_token_us = 147
decode_step_ms = 50
decode_request_us = 100
decode_kv_token_ns = 30
dp_attention = 1
moe_prefill_token_us = 74
moe_decode_token_us = 56
eager_decode_ms = 12
deepep_normal_ms = 6
idle_pass_ms = 1
server_chunked_prefill_size = 8192
slo_ttft_ms = 5000
slo_tpot_ms = 100
kv_bytes_per_token = 70272
kv_link_gbps = 40
kv_transfer_ms = 1
bootstrap_rtt_ms = 2
