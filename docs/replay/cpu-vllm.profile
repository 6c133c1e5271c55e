# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup vllm record`: 129 prefill steps and 17089 decode steps
# (a least-absolute-deviation fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 18.5 % / 60.1 %; decode 28.4 % / 86.7 %
name = replay-study-cpu-vllm
description = fitted from a step log (18256 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup vllm record`
kv_capacity_tokens = 1048576
max_running_requests = 128
chunked_prefill_size = 2048
prefill_step_ms = 2.35186
prefill_token_us = 8.53042
decode_step_ms = 1.36791
decode_request_us = 96.5943
decode_kv_token_ns = 185.673
# frontend_ms: 40 lone requests on the idle server: client TTFT less the fitted model's, median (p10 4.3 ms, p90 9.7 ms)
frontend_ms = 5.45173
