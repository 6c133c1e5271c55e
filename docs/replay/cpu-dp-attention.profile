# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup dp-attention record`: 1040 prefill steps and 20596 decode steps
# (a least-absolute-deviation fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 25.1 % / 58.2 %; decode 20.0 % / 51.7 %; decode in an extend step 18.5 % / 46.8 %
name = replay-study-cpu-dp-attention
description = fitted from a step log (DP attention, 25220 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup dp-attention record`
kv_capacity_tokens = 8192
max_running_requests = 8
chunked_prefill_size = 2048
dp_attention = 1
prefill_step_ms = 16.2375
prefill_token_us = 3.60476
decode_step_ms = 10.4408
decode_request_us = 474.869
decode_kv_token_ns = 1463.06
eager_decode_ms = 1.43146
# frontend_ms: 360 requests at the light load, SGLang's request time stats (--enable-metrics): client TTFT less the scheduler's receipt-to-prefill-end, median, less the simulator's 0.5 ms transit; lone requests on the idle server: 215.5 ms
frontend_ms = 12.8777
