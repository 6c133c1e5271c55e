# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup independent record`: 1706 prefill steps and 45964 decode steps
# (a prefill by its median step (least absolute deviations), decode by its mean step (least squares) fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 16.3 % / 42.6 %; decode 17.9 % / 39.5 %; decode right after a prefill 21.1 % / 51.8 %
name = replay-study-cpu
description = fitted from a step log (49168 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup independent record`
kv_capacity_tokens = 8192
max_running_requests = 16
chunked_prefill_size = 4096
prefill_step_ms = 2.86478
prefill_token_us = 13.7115
prefill_attention_ps = 13003.5
decode_step_ms = 2.08374
decode_request_us = 232.008
decode_kv_token_ns = 570.425
decode_after_prefill_ms = 0.742484
# the forward ran in the scheduler's thread (run_batch returned once it was done)
sync_forward = 1
# where in the next step's time a step's result was processed (median share, from its start)
result_share = 0.946
# frontend_ms: 360 requests at the light load, SGLang's request time stats (--enable-metrics): client TTFT less the scheduler's receipt-to-prefill-end, median, less the simulator's 0.5 ms transit and its 0.5 ms wait for the scheduler loop's turn; lone requests on the idle server: 2.7 ms
frontend_ms = 9.96968
