/* dpboard's load formula and GPU-direct publish, generated from dpboard/loads/formula.py by
 * tools/gen_layout.py: do not edit; change formula.py and regenerate (make layout).
 * The includer defines i64 (long long) first, as kernels/loads.cu does. */
#ifndef DPBOARD_LOADS_H
#define DPBOARD_LOADS_H

#include "dpboard_layout.h"
#include "dpb_seqlock_gpu.h"

DPB_FN i64 dpb_max(i64 a, i64 b) { return a > b ? a : b; }

/* The load formula: a snapshot's six figures from the raw counters, in KVLoads' order. */
DPB_FN void dpb_load_figures(const i64 *raw, i64 num_pages, i64 page_size, i64 *num_running_reqs_out,
        i64 *num_waiting_reqs_out, i64 *num_used_tokens_out, i64 *num_total_tokens_out, i64 *num_active_tokens_out,
        i64 *max_total_num_tokens_out) {
    i64 num_running_reqs = raw[DPB_RAW_RUNNING];
    i64 num_waiting_reqs = raw[DPB_RAW_WAITING];
    i64 num_used_tokens = (num_pages - raw[DPB_RAW_FREE_PAGES] - raw[DPB_RAW_EVICTABLE_PAGES]) * page_size;
    i64 num_total_tokens = num_used_tokens + raw[DPB_RAW_SEQLEN_WITHOUT_KV];
    i64 num_active_tokens = dpb_max(0, num_total_tokens - raw[DPB_RAW_SEQLEN_AWAITING_TRANSFER]);
    i64 max_total_num_tokens = num_pages * page_size;
    *num_running_reqs_out = num_running_reqs;
    *num_waiting_reqs_out = num_waiting_reqs;
    *num_used_tokens_out = num_used_tokens;
    *num_total_tokens_out = num_total_tokens;
    *num_active_tokens_out = num_active_tokens;
    *max_total_num_tokens_out = max_total_num_tokens;
}

/* Whether the tables had bad entries: then nothing is published. */
DPB_FN int dpb_has_errors(const i64 *raw) {
    return raw[DPB_RAW_BAD_REQ_STATES] != 0 || raw[DPB_RAW_BAD_PAGE_STATES] != 0 || raw[DPB_RAW_BAD_SEQLENS] != 0;
}

/* The seqlocked write of a whole snapshot into a board slot by its only writer; returns its publish_seq (the
 * slot's own count, continued). A kernel publishes no detail: its flags word is 0. */
DPB_FN i64 dpb_write_slot(volatile i64 *slot, const i64 *raw, i64 num_pages, i64 page_size, i64 dp_rank,
        i64 num_received_reqs, i64 timestamp_ns, i64 monotonic_ns, i64 writer_pid, i64 node_id) {
    i64 num_running_reqs, num_waiting_reqs, num_used_tokens, num_total_tokens, num_active_tokens,
            max_total_num_tokens;
    dpb_load_figures(raw, num_pages, page_size, &num_running_reqs, &num_waiting_reqs, &num_used_tokens,
            &num_total_tokens, &num_active_tokens, &max_total_num_tokens);
    i64 seq = slot[DPB_SEQ_OFFSET / 8];
    if (seq & 1) {  // left odd by a writer that died mid-write: step past it
        seq += 1;
    }
    i64 publish_seq = dpb_max(0, slot[DPB_FIELDS_OFFSET / 8 + DPB_F_PUBLISH_SEQ]) + 1;
    dpb_gpu_seq_open(slot, seq + 1);  // [W0] odd: a write is in progress, [W1]
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_DP_RANK] = dp_rank;  // [WD] from here to W_DETAIL_FLAGS
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NUM_RUNNING_REQS] = num_running_reqs;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NUM_WAITING_REQS] = num_waiting_reqs;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NUM_USED_TOKENS] = num_used_tokens;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NUM_TOTAL_TOKENS] = num_total_tokens;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NUM_ACTIVE_TOKENS] = num_active_tokens;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_MAX_TOTAL_NUM_TOKENS] = max_total_num_tokens;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NUM_RECEIVED_REQS] = num_received_reqs;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_TIMESTAMP_NS] = timestamp_ns;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_MONOTONIC_NS] = monotonic_ns;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_PUBLISH_SEQ] = publish_seq;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_WRITER_PID] = writer_pid;
    slot[DPB_FIELDS_OFFSET / 8 + DPB_F_NODE_ID] = node_id;
    slot[DPB_DETAIL_OFFSET / 8] = 0;
    dpb_gpu_seq_close(slot, seq + 1);  // [W2] even: the snapshot is whole
    return publish_seq;
}

/* What a GPU-direct publish does with the totals: the snapshot into the slot, unless the tables were bad, and
 * the outcome into the status words, the launch id last (the host reads it first). */
DPB_FN void dpb_publish_raw(const i64 *raw, i64 num_pages, i64 page_size, volatile i64 *slot, volatile i64 *status,
        i64 dp_rank, i64 num_received_reqs, i64 timestamp_ns, i64 monotonic_ns, i64 writer_pid, i64 node_id,
        i64 launch_id) {
    status[DPB_DIRECT_BAD_REQ_STATES] = raw[DPB_RAW_BAD_REQ_STATES];
    status[DPB_DIRECT_BAD_PAGE_STATES] = raw[DPB_RAW_BAD_PAGE_STATES];
    status[DPB_DIRECT_BAD_SEQLENS] = raw[DPB_RAW_BAD_SEQLENS];
    if (dpb_has_errors(raw)) {  // never publish numbers made from a broken table
        status[DPB_DIRECT_PUBLISHED] = 0;
        dpb_gpu_fence_system();
        status[DPB_DIRECT_LAUNCH_ID] = launch_id;
        return;
    }
    i64 publish_seq = dpb_write_slot(slot, raw, num_pages, page_size, dp_rank, num_received_reqs, timestamp_ns,
            monotonic_ns, writer_pid, node_id);
    status[DPB_DIRECT_PUBLISH_SEQ] = publish_seq;
    status[DPB_DIRECT_PUBLISHED] = 1;
    dpb_gpu_fence_system();
    status[DPB_DIRECT_LAUNCH_ID] = launch_id;
}

#endif /* DPBOARD_LOADS_H */
