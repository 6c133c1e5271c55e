# Fitted by `dpboard calibrate` from the step logs of `replay_study.py record`: 987 prefill steps and 20637 decode steps
# (a least-absolute-deviation fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 37.3 % / 107.2 %; decode 17.1 % / 44.9 %
name = replay-study-cpu
description = fitted from a step log (21624 steps)
source = dpboard calibrate the step logs of `replay_study.py record`
kv_capacity_tokens = 8192
max_running_requests = 16
chunked_prefill_size = 4096
prefill_step_ms = 6.52995
prefill_token_us = 2.90049
decode_step_ms = 2.00967
decode_request_us = 121.191
decode_kv_token_ns = 890.15
