/* dpboard's board layout and shared codes, generated from dpboard/snapshot.py by
 * tools/gen_layout.py: do not edit; change snapshot.py and regenerate (make layout). */
#ifndef DPBOARD_LAYOUT_H
#define DPBOARD_LAYOUT_H

#define DPB_LAYOUT_VERSION 3
#define DPB_HEADER_SIZE 512
#define DPB_SLOT_SIZE 512
#define DPB_SEQ_OFFSET 0
#define DPB_FIELDS_OFFSET 8
#define DPB_OWNER_OFFSET 112
#define DPB_OWNER_PID_BITS 22
#define DPB_RESERVED_OFFSET 120
#define DPB_DETAIL_OFFSET 128
#define DPB_DETAIL_SIZE 352
#define DPB_DETAIL_WORDS 44
#define DPB_DETAIL_PRESENT 1
#define DPB_DETAILED_RECORD_SIZE 464
#define DPB_DIRECT_SLOT_WORDS 17
#define DPB_RECORD_SIZE 112
#define DPB_RECORD_STATUS_OFFSET 104

/* LoadSnapshot fields: int64 each, in this order after the sequence word. */
#define DPB_NUM_FIELDS 13
#define DPB_F_DP_RANK 0
#define DPB_F_NUM_RUNNING_REQS 1
#define DPB_F_NUM_WAITING_REQS 2
#define DPB_F_NUM_USED_TOKENS 3
#define DPB_F_NUM_TOTAL_TOKENS 4
#define DPB_F_NUM_ACTIVE_TOKENS 5
#define DPB_F_MAX_TOTAL_NUM_TOKENS 6
#define DPB_F_NUM_RECEIVED_REQS 7
#define DPB_F_TIMESTAMP_NS 8
#define DPB_F_MONOTONIC_NS 9
#define DPB_F_PUBLISH_SEQ 10
#define DPB_F_WRITER_PID 11
#define DPB_F_NODE_ID 12
#define DPB_F_LOAD_FIRST 1
#define DPB_F_LOAD_LAST 7
#define DPB_FIELD_NAMES_INIT "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens", "num_active_tokens", "max_total_num_tokens", "num_received_reqs", "timestamp_ns", "monotonic_ns", "publish_seq", "writer_pid", "node_id"

/* SlotStatus */
#define DPB_STATUS_EMPTY 0
#define DPB_STATUS_LIVE 1
#define DPB_STATUS_STALE 2
#define DPB_STATUS_TORN 3
#define DPB_NUM_STATUSES 4

/* ReqState and PageState codes of the load kernels' tables */
#define DPB_REQ_FREE 0
#define DPB_REQ_RUNNING 1
#define DPB_REQ_WAITING 2
#define DPB_REQ_BOOTSTRAP 3
#define DPB_REQ_PREALLOC 4
#define DPB_REQ_TRANSFER 5
#define DPB_REQ_RETRACTED 6
#define DPB_NUM_REQ_STATES 7
#define DPB_PAGE_FREE 0
#define DPB_PAGE_USED 1
#define DPB_PAGE_EVICTABLE 2
#define DPB_NUM_PAGE_STATES 3
#define DPB_MAX_SEQLEN 4294967296LL

/* The raw counters every load backend produces */
#define DPB_RAW_RUNNING 0
#define DPB_RAW_WAITING 1
#define DPB_RAW_SEQLEN_WITHOUT_KV 2
#define DPB_RAW_SEQLEN_AWAITING_TRANSFER 3
#define DPB_RAW_FREE_PAGES 4
#define DPB_RAW_EVICTABLE_PAGES 5
#define DPB_RAW_BAD_REQ_STATES 6
#define DPB_RAW_BAD_PAGE_STATES 7
#define DPB_RAW_BAD_SEQLENS 8
#define DPB_NUM_RAW 9

/* GPU-direct status words */
#define DPB_DIRECT_LAUNCH_ID 0
#define DPB_DIRECT_PUBLISHED 1
#define DPB_DIRECT_BAD_REQ_STATES 2
#define DPB_DIRECT_BAD_PAGE_STATES 3
#define DPB_DIRECT_BAD_SEQLENS 4
#define DPB_DIRECT_PUBLISH_SEQ 5
#define DPB_DIRECT_STATUS_WORDS 8

#endif /* DPBOARD_LAYOUT_H */
