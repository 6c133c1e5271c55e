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
# The blog ran prefill and decode on separate nodes (PD disaggregation); this profile puts both on
# one rank, and the simulator does not model the lockstep of MoE DP ranks (all ranks step together
# for the expert all-to-all).
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
