# The rank model dpboard sim has always used for its synthetic scenarios (steady, bursty,
# longshort): round numbers in the range of an 8B model on one H100-class GPU, not a calibration.
# No chunked prefill: a prompt is one step however long (up to max_prefill_tokens per step, and
# always at least one whole prompt).
name = synthetic
description = round numbers in the range of an 8B model on one H100-class GPU (no chunked prefill)
source = none: chosen by hand for the synthetic scenarios
kv_capacity_tokens = 160000
max_running_requests = 128
chunked_prefill_size = 0
max_prefill_tokens = 16384
prefill_step_ms = 4
prefill_token_us = 40
decode_step_ms = 10
decode_request_us = 0
decode_kv_token_ns = 60
