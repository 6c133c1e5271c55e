# Fitted by `dpboard calibrate` from the step logs of `replay_study.py --setup dp-attention record`: 1057 prefill steps and 18523 decode steps
# (a prefill by its median step (least absolute deviations), decode by its mean step (least squares) fit of the rank model's own terms; capacities from the log's header).
# Absolute error per step, median / p90: prefill 19.5 % / 51.0 %; decode 22.4 % / 60.1 %; decode right after a prefill 20.0 % / 55.2 %; decode in an extend step 24.5 % / 64.6 %
name = replay-study-cpu-dp-attention
description = fitted from a step log (DP attention, 23744 steps)
source = dpboard calibrate the step logs of `replay_study.py --setup dp-attention record`
kv_capacity_tokens = 8192
max_running_requests = 8
chunked_prefill_size = 2048
dp_attention = 1
prefill_step_ms = 15.8133
prefill_token_us = 14.9589
prefill_attention_ps = 14273.6
decode_step_ms = 11.7719
decode_request_us = 777.758
decode_kv_token_ns = 1065.53
decode_after_prefill_ms = 0.505256
eager_decode_ms = 1.37827
# the forward ran in the scheduler's thread (run_batch returned once it was done)
sync_forward = 1
# where in the next step's time a step's result was processed (median share, from its start)
result_share = 0.809
# frontend_ms: 360 requests at the light load, SGLang's request time stats (--enable-metrics): client TTFT less the scheduler's receipt-to-prefill-end, median, less the simulator's 0.5 ms transit and its 7.1 ms wait for the scheduler loop's turn; lone requests on the idle server: 199.9 ms
frontend_ms = 6.92949
