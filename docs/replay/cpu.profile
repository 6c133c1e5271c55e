# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup independent record`: 1361 prefill steps and 25486 decode steps
# (a prefill by its median step (least absolute deviations), decode by its mean step (least squares) fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 16.9 % / 42.4 %; decode 17.9 % / 40.1 %; decode right after a prefill 16.9 % / 45.2 %
name = replay-study-cpu
description = fitted from a step log (28008 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup independent record`
kv_capacity_tokens = 8192
max_running_requests = 16
chunked_prefill_size = 4096
prefill_step_ms = 2.54114
prefill_token_us = 15.2264
prefill_attention_ps = 7517.25
decode_step_ms = 1.69275
decode_request_us = 177.112
decode_kv_token_ns = 1015.31
decode_after_prefill_ms = 0.451824
# the forward ran in the scheduler's thread (run_batch returned once it was done)
sync_forward = 1
# frontend_ms: 360 requests at the light load, SGLang's request time stats (--enable-metrics): client TTFT less the scheduler's receipt-to-prefill-end, median, less the simulator's 0.5 ms transit; lone requests on the idle server: 2.2 ms
frontend_ms = 9.03373
