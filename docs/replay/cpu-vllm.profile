# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup vllm record`: 129 prefill steps and 16973 decode steps
# (a prefill by its median step (least absolute deviations), decode by its mean step (least squares) fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 18.5 % / 60.1 %; decode 30.5 % / 107.1 %; decode right after a prefill 24.6 % / 63.8 %
name = replay-study-cpu-vllm
description = fitted from a step log (18256 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup vllm record`
kv_capacity_tokens = 1048576
max_running_requests = 128
chunked_prefill_size = 2048
prefill_step_ms = 2.35186
prefill_token_us = 8.53042
prefill_attention_ps = 0
decode_step_ms = 1.5717
decode_request_us = 94.2126
decode_kv_token_ns = 207.991
decode_after_prefill_ms = 0.189292
# frontend_ms: 40 lone requests on the idle server: client TTFT less the fitted model's, median (p10 4.3 ms, p90 9.7 ms)
frontend_ms = 5.45173
