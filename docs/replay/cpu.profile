# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup independent record`: 1330 prefill steps and 26735 decode steps
# (a least-absolute-deviation fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 39.7 % / 112.8 %; decode 13.9 % / 37.8 %
name = replay-study-cpu
description = fitted from a step log (28065 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup independent record`
kv_capacity_tokens = 8192
max_running_requests = 16
chunked_prefill_size = 4096
prefill_step_ms = 6.4192
prefill_token_us = 2.55004
decode_step_ms = 1.58668
decode_request_us = 251.258
decode_kv_token_ns = 738.315
# frontend_ms: 360 requests at the light load, SGLang's request time stats (--enable-metrics): client TTFT less the scheduler's receipt-to-prefill-end, median, less the simulator's 0.5 ms transit; lone requests on the idle server: 5.3 ms
frontend_ms = 9.03373
