/*
 * board_module.h: what the C files of the extension module dpboard.board._seqlock share. One module,
 * built from one file per part (setup.py lists them):
 *
 *   board_module.c  the module: its types and functions, and the layout it was compiled with
 *   slot_writer.c   SlotWriter: a board slot's one writer (publish, publish_values, publish_relayed,
 *                   retire), and the slot's sequence kept by the writer
 *   board_reader.c  BoardView: seqlocked reads of every slot (read, read_array, read_detailed, ...)
 *                   and the LIVE/STALE window
 *   side_rows.c     SeqRow and read_rows: the seqlocked rows of the side records (sent, dispatch)
 *   claim.c         slot_owner and claim_slot: the owner word and its compare-and-swap
 *
 * The seqlock that the writer, the reader and the side rows share, with its memory-ordering
 * argument, is dpb_seqlock.h. Every layout fact (offsets, sizes, field indices, status codes) comes
 * from dpboard_layout.h, generated from dpboard/snapshot.py by tools/gen_layout.py; the module
 * exports them and the package compares them at import.
 */
#ifndef DPB_BOARD_MODULE_H
#define DPB_BOARD_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "dpboard_layout.h"

#define SLOT_SIZE DPB_SLOT_SIZE
#define NUM_FIELDS DPB_NUM_FIELDS
#define FIELDS_OFFSET DPB_FIELDS_OFFSET
#define OWNER_OFFSET DPB_OWNER_OFFSET
#define DETAIL_OFFSET DPB_DETAIL_OFFSET
#define DETAIL_WORDS DPB_DETAIL_WORDS
#define DETAIL_SIZE DPB_DETAIL_SIZE
#define RECORD_SIZE DPB_RECORD_SIZE
#define RECORD_STATUS_OFFSET DPB_RECORD_STATUS_OFFSET
#define F_DP_RANK DPB_F_DP_RANK
#define F_NUM_LOAD_LAST DPB_F_LOAD_LAST
#define F_TIMESTAMP_NS DPB_F_TIMESTAMP_NS
#define F_MONOTONIC_NS DPB_F_MONOTONIC_NS
#define F_PUBLISH_SEQ DPB_F_PUBLISH_SEQ
#define F_WRITER_PID DPB_F_WRITER_PID
#define F_NODE_ID DPB_F_NODE_ID

enum { ST_EMPTY = DPB_STATUS_EMPTY, ST_LIVE = DPB_STATUS_LIVE, ST_STALE = DPB_STATUS_STALE, ST_TORN = DPB_STATUS_TORN };

/* Shared between the module's files only: not exported from the shared object. */
#define DPB_INTERNAL __attribute__((visibility("hidden")))

DPB_INTERNAL extern PyTypeObject SlotWriterType;   /* slot_writer.c */
DPB_INTERNAL extern PyTypeObject BoardViewType;    /* board_reader.c */
DPB_INTERNAL extern PyTypeObject SeqRowType;       /* side_rows.c */
DPB_INTERNAL extern PyMethodDef side_rows_functions[]; /* side_rows.c: read_rows */
DPB_INTERNAL extern PyMethodDef claim_functions[];     /* claim.c: slot_owner, claim_slot */

static inline int64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#endif /* DPB_BOARD_MODULE_H */
