/*
 * dpboard.board._seqlock: the seqlocked slot writer and the board reader, the two hot paths of the board.
 *
 * A slot is a 64-bit sequence word, then the int64 fields of a LoadSnapshot, then the owner word
 * and a reserved word, then the detail words (an engine's whole snapshot beyond the dispatch fields;
 * docs/FORMAT.md; the offsets come from dpboard_layout.h). One sequence covers fields and detail:
 * a dispatch read copies the fields only, a detailed read both, and either is one whole write. One writer per slot;
 * any number of readers, in any process that maps the board. The owner word (pid and process start
 * time in one 64-bit value) is claimed with a compare-and-swap, so two would-be writers racing for
 * a slot cannot both win.
 *
 * The seqlock itself, with its memory-ordering argument, is dpb_seqlock.h: the same one guards the
 * rows of the side records (the sent and dispatch records), which this module also writes and reads
 * (SeqRow, read_rows). A slot's writer keeps its sequence in local_seq (always even); a writer killed
 * between its two sequence stores leaves the slot odd, readers give up after max_retries and report
 * TORN, and the next writer of that slot starts from the odd value rounded up, so its first publish
 * makes the slot whole again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "dpb_seqlock.h"

/* Every layout fact (offsets, sizes, field indices, status codes) comes from the header generated
   from dpboard/snapshot.py; the module exports them and the package compares them at import. */
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

_Static_assert(DPB_SEQ_OFFSET == 0, "the sequence word opens the slot");
_Static_assert(FIELDS_OFFSET % 8 == 0 && FIELDS_OFFSET >= 8, "fields are aligned int64 after the sequence");
_Static_assert(FIELDS_OFFSET + 8 * NUM_FIELDS <= OWNER_OFFSET, "the fields end before the owner word");
_Static_assert(OWNER_OFFSET % 8 == 0 && OWNER_OFFSET + 8 <= SLOT_SIZE, "the owner word is an aligned int64 in the slot");
_Static_assert(SLOT_SIZE % 128 == 0, "slots are whole 128-byte lines: two writers never share a line");
_Static_assert(DETAIL_OFFSET % 8 == 0 && DETAIL_OFFSET >= OWNER_OFFSET + 8 && DETAIL_SIZE == 8 * DETAIL_WORDS &&
                   DETAIL_OFFSET + DETAIL_SIZE <= SLOT_SIZE,
               "the detail words follow the owner word inside the slot");
_Static_assert(DPB_DETAILED_RECORD_SIZE == RECORD_SIZE + DETAIL_SIZE, "a detailed record is a record, then the detail");
_Static_assert(DPB_HEADER_SIZE % 128 == 0, "slots start on a 128-byte boundary");
_Static_assert(RECORD_STATUS_OFFSET == 8 * NUM_FIELDS && RECORD_STATUS_OFFSET < RECORD_SIZE,
               "a read_array record is the fields, then the status byte");
_Static_assert(RECORD_SIZE % 8 == 0, "records stay 8-byte aligned in an array");
_Static_assert(DPB_NUM_STATUSES == 4, "the reader knows four slot statuses");

static const char *const FIELD_NAMES[NUM_FIELDS] = {DPB_FIELD_NAMES_INIT};


static inline int64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------- */
/* The write side.                                                                             */

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* an export of the board mapping: keeps it mapped while this writer lives */
    int has_view;
    char *slot;
    uint64_t local_seq; /* the slot's sequence as this writer left it (always even) */
    int64_t publish_seq;
    int64_t rank;
    int64_t pid;
    int64_t node_id;
} SlotWriter;

/* `detail`: DETAIL_WORDS words to store with the fields, or NULL for none (the flags word, the
   detail's first, becomes 0, so a reader sees no stale detail beside new fields). */
static inline void seqlock_write(SlotWriter *w, const int64_t *values, const uint64_t *detail) {
    uint64_t *seq = (uint64_t *)w->slot;
    int64_t *fields = (int64_t *)(w->slot + FIELDS_OFFSET);
    uint64_t *words = (uint64_t *)(w->slot + DETAIL_OFFSET);
    uint64_t odd = w->local_seq + 1;
    dpb_seq_open(seq, odd);
    dpb_store_words((uint64_t *)fields, (const uint64_t *)values, NUM_FIELDS);
    if (detail == NULL) {
        __atomic_store_n(&words[0], (uint64_t)0, __ATOMIC_RELAXED);
    } else {
        dpb_store_words(words, detail, DETAIL_WORDS);
    }
    dpb_seq_close(seq, odd);
    w->local_seq = odd + 1;
}

/* The detail argument of publish()/publish_relayed(): None, or a buffer of exactly DETAIL_SIZE bytes
   (a DETAIL_DTYPE record, as dpboard.snapshot.pack_detail makes). Copied out, so that the buffer may
   be reused and is never read inside the write. Returns 0 (no detail), 1 (copied) or -1. */
static int get_detail(PyObject *obj, uint64_t *out) {
    if (obj == Py_None) return 0;
    Py_buffer buf;
    if (PyObject_GetBuffer(obj, &buf, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (buf.len != DETAIL_SIZE) {
        PyErr_Format(PyExc_ValueError, "detail must be %d bytes (one DETAIL_DTYPE record: pack_detail()), got %zd",
                     DETAIL_SIZE, buf.len);
        PyBuffer_Release(&buf);
        return -1;
    }
    memcpy(out, buf.buf, DETAIL_SIZE);
    PyBuffer_Release(&buf);
    return 1;
}

static void writer_dealloc(SlotWriter *self) {
    if (self->has_view) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A closed writer (BoardWriter.close(), or one replaced by a takeover in its own process) has no
   slot: every write is refused, so that two writers of one slot never interleave their sequences. */
static inline int writer_open(SlotWriter *self) {
    if (self->slot != NULL) return 0;
    PyErr_Format(PyExc_ValueError,
                 "the writer of slot %lld is closed: take a new one with board.writer(%lld)",
                 (long long)self->rank, (long long)self->rank);
    return -1;
}

/* SlotWriter(mapping, offset, rank, node_id, pid) */
static int writer_init(SlotWriter *self, PyObject *args, PyObject *kwds) {
    PyObject *mapping;
    Py_ssize_t offset;
    long long rank, node_id, pid;
    static char *kwlist[] = {"mapping", "offset", "rank", "node_id", "pid", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnLLL", kwlist, &mapping, &offset, &rank, &node_id, &pid))
        return -1;
    /* __init__ again on a live writer: it is closed first, so that a failure below leaves a closed
       writer, never a slot pointer into a released buffer. */
    self->slot = NULL;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(mapping, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->has_view = 1;
    /* Written so that no sum can overflow, whatever offset Python passes. */
    if (offset < 0 || offset % SLOT_SIZE != 0 || self->view.len < SLOT_SIZE || offset > self->view.len - SLOT_SIZE) {
        PyErr_Format(PyExc_ValueError, "slot offset %zd is outside the %zd-byte board mapping", offset,
                     self->view.len);
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        return -1;
    }
    self->slot = (char *)self->view.buf + offset;
    self->rank = rank;
    self->node_id = node_id;
    self->pid = pid;
    uint64_t s = __atomic_load_n((uint64_t *)self->slot, __ATOMIC_ACQUIRE);
    /* A slot left odd by a dead writer: start from the next even value, so the first publish
       of this writer goes odd -> even past it and repairs the slot. */
    self->local_seq = (s & 1) ? s + 1 : s;
    self->publish_seq = __atomic_load_n((int64_t *)(self->slot + FIELDS_OFFSET) + F_PUBLISH_SEQ,
                                        __ATOMIC_RELAXED);
    if (self->publish_seq < 0) self->publish_seq = 0;
    return 0;
}

/* One load field (index k) from a Python int; `prefix` names where it came from in the error. */
static inline int parse_load_field(PyObject *item, int k, const char *prefix, int64_t *out) {
    long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s%s must be an integer in [0, 2**63), got %R", prefix, FIELD_NAMES[k],
                     item);
        return -1;
    }
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s%s must be >= 0, got %lld", prefix, FIELD_NAMES[k], v);
        return -1;
    }
    *out = v;
    return 0;
}

static int read_load_fields(PyObject *snap, int64_t *values, int64_t expected_rank) {
    if (!PyTuple_Check(snap) || PyTuple_GET_SIZE(snap) != NUM_FIELDS) {
        PyErr_Format(PyExc_TypeError, "publish() takes a LoadSnapshot, got %.100s", Py_TYPE(snap)->tp_name);
        return -1;
    }
    for (int k = 0; k <= F_NUM_LOAD_LAST; k++)
        if (parse_load_field(PyTuple_GET_ITEM(snap, k), k, "LoadSnapshot.", &values[k]) < 0) return -1;
    if (values[F_DP_RANK] != expected_rank) {
        PyErr_Format(PyExc_ValueError,
                     "LoadSnapshot.dp_rank is %lld but this writer owns slot %lld: publish each rank "
                     "through board.writer(rank=dp_rank)",
                     (long long)values[F_DP_RANK], (long long)expected_rank);
        return -1;
    }
    return 0;
}

static inline void stamp(SlotWriter *self, int64_t *values) {
    values[F_TIMESTAMP_NS] = clock_ns(CLOCK_REALTIME);
    values[F_MONOTONIC_NS] = clock_ns(CLOCK_MONOTONIC);
    values[F_PUBLISH_SEQ] = ++self->publish_seq;
    values[F_WRITER_PID] = self->pid;
    values[F_NODE_ID] = self->node_id;
}

/* The (snapshot[, detail]) arguments of publish() and publish_relayed(). */
static int publish_args(const char *name, PyObject *const *args, Py_ssize_t nargs, uint64_t *detail, int *has_detail) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s(snapshot, detail=None) takes 1 or 2 arguments, got %zd", name, nargs);
        return -1;
    }
    *has_detail = nargs == 2 ? get_detail(args[1], detail) : 0;
    return *has_detail < 0 ? -1 : 0;
}

static PyObject *writer_publish(SlotWriter *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t values[NUM_FIELDS];
    uint64_t detail[DETAIL_WORDS];
    int has_detail;
    if (writer_open(self) < 0 || publish_args("publish", args, nargs, detail, &has_detail) < 0) return NULL;
    if (read_load_fields(args[0], values, self->rank) < 0) return NULL;
    stamp(self, values);
    seqlock_write(self, values, has_detail ? detail : NULL);
    Py_RETURN_NONE;
}

/* publish_values(num_running_reqs, num_waiting_reqs, num_used_tokens, num_total_tokens,
                  num_active_tokens, max_total_num_tokens, num_received_reqs) */
static PyObject *writer_publish_values(SlotWriter *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t values[NUM_FIELDS];
    if (writer_open(self) < 0) return NULL;
    if (nargs != F_NUM_LOAD_LAST) {
        PyErr_Format(PyExc_TypeError,
                     "publish_values() takes the 7 load fields (num_running_reqs .. num_received_reqs), "
                     "got %zd arguments", nargs);
        return NULL;
    }
    values[F_DP_RANK] = self->rank;
    for (int k = 1; k <= F_NUM_LOAD_LAST; k++)
        if (parse_load_field(args[k - 1], k, "", &values[k]) < 0) return NULL;
    stamp(self, values);
    seqlock_write(self, values, NULL);
    Py_RETURN_NONE;
}

/* publish_relayed(snapshot): copy a snapshot written on another node. Keeps its timestamp_ns,
   publish_seq, writer_pid and node_id; stamps monotonic_ns with this node's clock (the receive
   time), since another node's monotonic clock means nothing here. */
static PyObject *writer_publish_relayed(SlotWriter *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t values[NUM_FIELDS];
    uint64_t detail[DETAIL_WORDS];
    int has_detail;
    if (writer_open(self) < 0 || publish_args("publish_relayed", args, nargs, detail, &has_detail) < 0)
        return NULL;
    PyObject *snap = args[0];
    if (read_load_fields(snap, values, self->rank) < 0) return NULL;
    for (int k = F_TIMESTAMP_NS; k < NUM_FIELDS; k++) {
        PyObject *item = PyTuple_GET_ITEM(snap, k);
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "LoadSnapshot.%s must be a 64-bit integer, got %R", FIELD_NAMES[k],
                         item);
            return NULL;
        }
        values[k] = v;
    }
    values[F_MONOTONIC_NS] = clock_ns(CLOCK_MONOTONIC);
    seqlock_write(self, values, has_detail ? detail : NULL);
    Py_RETURN_NONE;
}

/* Test-only: publish with a pause between the odd store and the rest, so that a test can kill
   the process mid-write. The pause releases the GIL. */
static PyObject *writer_publish_paused(SlotWriter *self, PyObject *args) {
    PyObject *snap;
    double seconds;
    int64_t values[NUM_FIELDS];
    if (writer_open(self) < 0 || !PyArg_ParseTuple(args, "Od", &snap, &seconds)) return NULL;
    if (read_load_fields(snap, values, self->rank) < 0) return NULL;
    stamp(self, values);
    uint64_t *seq = (uint64_t *)self->slot;
    int64_t *fields = (int64_t *)(self->slot + FIELDS_OFFSET);
    uint64_t odd = self->local_seq + 1;
    dpb_seq_open(seq, odd);
    for (int k = 0; k < NUM_FIELDS / 2; k++) __atomic_store_n(&fields[k], values[k], __ATOMIC_RELAXED);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    Py_BEGIN_ALLOW_THREADS nanosleep(&ts, NULL);
    Py_END_ALLOW_THREADS
    for (int k = NUM_FIELDS / 2; k < NUM_FIELDS; k++) __atomic_store_n(&fields[k], values[k], __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(self->slot + DETAIL_OFFSET), (uint64_t)0, __ATOMIC_RELAXED);
    dpb_seq_close(seq, odd);
    self->local_seq = odd + 1;
    Py_RETURN_NONE;
}

/* retire(): the writer leaves its slot, saying so at once: under the seqlock, monotonic_ns becomes
   0, a stamp no reader takes for a recent one, so the slot reads STALE from the next read on (not
   after stale_after) and holds its last fields for whoever reads them. Every other word is kept. */
static PyObject *writer_retire(SlotWriter *self, PyObject *unused) {
    if (writer_open(self) < 0) return NULL;
    uint64_t *seq = (uint64_t *)self->slot;
    int64_t *fields = (int64_t *)(self->slot + FIELDS_OFFSET);
    uint64_t odd = self->local_seq + 1;
    dpb_seq_open(seq, odd);
    __atomic_store_n(&fields[F_MONOTONIC_NS], (int64_t)0, __ATOMIC_RELAXED);
    dpb_seq_close(seq, odd);
    self->local_seq = odd + 1;
    Py_RETURN_NONE;
}

static PyObject *writer_get_slot_address(SlotWriter *self, void *closure) {
    if (writer_open(self) < 0) return NULL;
    return PyLong_FromVoidPtr(self->slot);
}

static PyObject *writer_get_sequence(SlotWriter *self, void *closure) {
    if (writer_open(self) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)self->slot, __ATOMIC_ACQUIRE));
}

static PyObject *writer_get_closed(SlotWriter *self, void *closure) { return PyBool_FromLong(self->slot == NULL); }

/* _release(): no more writes through this writer; drops its hold on the board mapping. */
static PyObject *writer_release(SlotWriter *self, PyObject *unused) {
    self->slot = NULL;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef writer_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))writer_publish, METH_FASTCALL,
     "publish(snapshot, detail=None): write a LoadSnapshot (and a packed LoadDetail, or none) into\n"
     "this writer's slot; the writer stamps timestamp_ns, monotonic_ns, publish_seq, writer_pid and node_id."},
    {"publish_values", (PyCFunction)(void (*)(void))writer_publish_values, METH_FASTCALL,
     "publish_values(num_running_reqs, num_waiting_reqs, num_used_tokens, num_total_tokens,\n"
     "num_active_tokens, max_total_num_tokens, num_received_reqs): publish without a LoadSnapshot."},
    {"publish_relayed", (PyCFunction)(void (*)(void))writer_publish_relayed, METH_FASTCALL,
     "publish_relayed(snapshot, detail=None): copy a snapshot from another node, stamping only monotonic_ns."},
    {"_publish_paused", (PyCFunction)writer_publish_paused, METH_VARARGS,
     "Test-only: publish with a pause (seconds) in the middle of the write."},
    {"retire", (PyCFunction)writer_retire, METH_NOARGS,
     "retire(): say the writer leaves: the slot reads STALE from the next read on (its stamp 0)."},
    {"_release", (PyCFunction)writer_release, METH_NOARGS,
     "_release(): refuse every later write and drop this writer's hold on the board mapping."},
    {NULL}};

static PyMemberDef writer_members[] = {
    {"rank", T_LONGLONG, offsetof(SlotWriter, rank), READONLY, "the slot's rank"},
    {"node_id", T_LONGLONG, offsetof(SlotWriter, node_id), READONLY, "stamped into every snapshot"},
    {"pid", T_LONGLONG, offsetof(SlotWriter, pid), READONLY, "stamped into every snapshot"},
    {"publish_seq", T_LONGLONG, offsetof(SlotWriter, publish_seq), READONLY,
     "number of publishes into this slot so far"},
    {NULL}};

static PyGetSetDef writer_getset[] = {
    {"slot_address", (getter)writer_get_slot_address, NULL,
     "address of the slot in this process (for GPU-direct publish)", NULL},
    {"sequence", (getter)writer_get_sequence, NULL, "the slot's current sequence word", NULL},
    {"closed", (getter)writer_get_closed, NULL, "True once the writer was closed (it writes no more)", NULL},
    {NULL}};

static PyTypeObject SlotWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpboard.board._seqlock.SlotWriter",
    .tp_basicsize = sizeof(SlotWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The single writer of one board slot.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)writer_init,
    .tp_dealloc = (destructor)writer_dealloc,
    .tp_methods = writer_methods,
    .tp_members = writer_members,
    .tp_getset = writer_getset,
};

/* ------------------------------------------------------------------------------------------- */
/* The read side.                                                                              */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    const char *slots;
    Py_ssize_t n_slots;
    long long stale_after_ns;
    int max_retries;
    PyObject *snapshot_type; /* LoadSnapshot */
    PyObject *statuses;      /* tuple of SlotStatus members, indexed by code */
    PyObject *out_obj;       /* the default read_array() output */
    Py_buffer out;
    int has_out;
} BoardView;

/* The stamps that read as LIVE: within stale_after of now on either side. A stamp from the future (a
   writer in a time namespace ahead of ours, a forged slot) is no more current than an old one. As
   one unsigned range check, stamp - from <= width with from = now - stale_after and width = 2 *
   stale_after: no signed overflow whatever stamp the writer chose, and no wrap-around while now <
   2**62 ns and stale_after <= MAX_STALE_AFTER_NS (view_init and the setter hold it there). */
typedef struct {
    uint64_t from, width;
} LiveWindow;

#define MAX_STALE_AFTER_NS 1000000000000000LL /* segment.MAX_STALE_AFTER, 1e6 s */

static inline LiveWindow live_window(long long stale_after) {
    uint64_t now = (uint64_t)clock_ns(CLOCK_MONOTONIC);
    return (LiveWindow){now - (uint64_t)stale_after, 2 * (uint64_t)stale_after};
}

/* Copies slot i into dst[0..12] and returns its status. Bounded by max_retries. */
/* Copies the fields of a slot into dst[0..NUM_FIELDS) and, when `detail` is not NULL, its detail
   words too, all from one write; returns the slot's status. Bounded by max_retries. Inlined with a
   NULL detail, the dispatch read does no work for the detail. */
static inline int read_slot_words(const char *slot, int64_t *dst, uint64_t *detail, int max_retries,
                                  LiveWindow live) {
    const uint64_t *seqp = (const uint64_t *)slot;
    const int64_t *fields = (const int64_t *)(slot + FIELDS_OFFSET);
    const uint64_t *words = (const uint64_t *)(slot + DETAIL_OFFSET);
    for (int attempt = 0; attempt < max_retries; attempt++) {
        uint64_t s1 = dpb_seq_read_begin(seqp);
        if (s1 & 1) {
            dpb_cpu_relax();
            continue;
        }
        if (s1 == 0) {
            memset(dst, 0, NUM_FIELDS * sizeof(int64_t));
            if (detail != NULL) memset(detail, 0, DETAIL_SIZE);
            return ST_EMPTY;
        }
        dpb_load_words((uint64_t *)dst, (const uint64_t *)fields, NUM_FIELDS);
        if (detail != NULL) dpb_load_words(detail, words, DETAIL_WORDS);
        if (dpb_seq_read_end(seqp, s1)) return ((uint64_t)dst[F_MONOTONIC_NS] - live.from > live.width) ? ST_STALE : ST_LIVE;
        dpb_cpu_relax();
    }
    memset(dst, 0, NUM_FIELDS * sizeof(int64_t));
    if (detail != NULL) memset(detail, 0, DETAIL_SIZE);
    return ST_TORN;
}

static inline int read_slot(const char *slot, int64_t *dst, int max_retries, LiveWindow live) {
    return read_slot_words(slot, dst, NULL, max_retries, live);
}

static void view_dealloc(BoardView *self) {
    if (self->has_view) PyBuffer_Release(&self->view);
    if (self->has_out) PyBuffer_Release(&self->out);
    Py_XDECREF(self->snapshot_type);
    Py_XDECREF(self->statuses);
    Py_XDECREF(self->out_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_record_buffer(PyObject *obj, Py_buffer *buf, Py_ssize_t n_slots) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (buf->len / RECORD_SIZE < n_slots || ((uintptr_t)buf->buf & 7) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "read_array(out=...) needs a C-contiguous, 8-byte aligned array of at least %zd "
                     "SNAPSHOT_DTYPE records (%zd bytes), got %zd bytes",
                     n_slots, n_slots * RECORD_SIZE, buf->len);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

static int check_stale_after_ns(long long stale_after_ns) {
    if (stale_after_ns < 1 || stale_after_ns > MAX_STALE_AFTER_NS) {
        PyErr_Format(PyExc_ValueError, "stale_after_ns must be in 1..%lld (1e6 s), got %lld", MAX_STALE_AFTER_NS,
                     stale_after_ns);
        return -1;
    }
    return 0;
}

/* BoardView(mapping, offset, n_slots, snapshot_type, statuses, out, stale_after_ns, max_retries);
   out: the reader's own SNAPSHOT_DTYPE array for read_array(), or None for the plain reads only */
static int view_init(BoardView *self, PyObject *args, PyObject *kwds) {
    PyObject *mapping, *snapshot_type, *statuses, *out;
    Py_ssize_t offset, n_slots;
    long long stale_after_ns;
    int max_retries;
    static char *kwlist[] = {"mapping", "offset", "n_slots", "snapshot_type", "statuses",
                             "out", "stale_after_ns", "max_retries", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnnOO!OLi", kwlist, &mapping, &offset, &n_slots,
                                     &snapshot_type, &PyTuple_Type, &statuses, &out, &stale_after_ns,
                                     &max_retries))
        return -1;
    if (!PyType_Check(snapshot_type) || !PyType_IsSubtype((PyTypeObject *)snapshot_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "snapshot_type must be a tuple subclass (LoadSnapshot)");
        return -1;
    }
    if (PyTuple_GET_SIZE(statuses) != 4) {
        PyErr_SetString(PyExc_ValueError, "statuses must hold the 4 SlotStatus members");
        return -1;
    }
    if (max_retries < 1) {
        PyErr_Format(PyExc_ValueError, "max_retries must be >= 1, got %d", max_retries);
        return -1;
    }
    if (check_stale_after_ns(stale_after_ns) < 0) return -1;
    /* __init__ again on a live view: emptied first, so that a failure below leaves a view of no
       slots, never pointers into released buffers. */
    self->slots = NULL;
    self->n_slots = 0;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (self->has_out) {
        PyBuffer_Release(&self->out);
        self->has_out = 0;
    }
    if (PyObject_GetBuffer(mapping, &self->view, PyBUF_SIMPLE) < 0) return -1;
    self->has_view = 1;
    /* Written so that no product or sum can overflow, whatever n_slots and offset Python passes. */
    if (offset < 0 || n_slots < 0 || offset > self->view.len || n_slots > (self->view.len - offset) / SLOT_SIZE) {
        PyErr_Format(PyExc_ValueError, "%zd slots at offset %zd do not fit the %zd-byte mapping", n_slots,
                     offset, self->view.len);
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        return -1;
    }
    /* out=None: a view for the plain reads (read, read_all, read_with_status, status), which hand
       Python values and need no array; its read_array() then takes one. */
    if (out != Py_None) {
        if (get_record_buffer(out, &self->out, n_slots) < 0) {
            PyBuffer_Release(&self->view);
            self->has_view = 0;
            return -1;
        }
        self->has_out = 1;
    }
    self->slots = (const char *)self->view.buf + offset;
    self->n_slots = n_slots;
    self->stale_after_ns = stale_after_ns;
    self->max_retries = max_retries;
    Py_XSETREF(self->snapshot_type, Py_NewRef(snapshot_type));
    Py_XSETREF(self->statuses, Py_NewRef(statuses));
    Py_XSETREF(self->out_obj, Py_NewRef(out));
    return 0;
}

static void fill_records(BoardView *self, char *dst) {
    LiveWindow live = live_window(self->stale_after_ns);
    for (Py_ssize_t i = 0; i < self->n_slots; i++) {
        char *rec = dst + i * RECORD_SIZE;
        int st = read_slot(self->slots + i * SLOT_SIZE, (int64_t *)rec, self->max_retries, live);
        if (st == ST_EMPTY || st == ST_TORN) ((int64_t *)rec)[F_DP_RANK] = i;
        rec[RECORD_STATUS_OFFSET] = (char)st;
    }
}

/* read_array(out=None): positional or keyword, parsed by hand to keep the hot path free of
   argument-parsing allocations. */
static PyObject *view_read_array(BoardView *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs + nkw > 1 ||
        (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "out") != 0)) {
        PyErr_SetString(PyExc_TypeError, "read_array() takes at most one argument, out");
        return NULL;
    }
    PyObject *out = nargs + nkw == 1 ? args[0] : Py_None;
    if (out == Py_None) {
        if (!self->has_out) {
            PyErr_SetString(PyExc_TypeError, "this reader was made without an array of its own (plain reads "
                                             "only): pass read_array(out=...) a SNAPSHOT_DTYPE array");
            return NULL;
        }
        fill_records(self, (char *)self->out.buf);
        Py_INCREF(self->out_obj);
        return self->out_obj;
    }
    Py_buffer buf;
    if (get_record_buffer(out, &buf, self->n_slots) < 0) return NULL;
    fill_records(self, (char *)buf.buf);
    PyBuffer_Release(&buf);
    Py_INCREF(out);
    return out;
}

static PyObject *make_snapshot(BoardView *self, const int64_t *values) {
    PyTypeObject *tp = (PyTypeObject *)self->snapshot_type;
#if PY_VERSION_HEX >= 0x030E0000
    /* 3.14 tuples cache their hash; let tuple's own constructor set that up. */
    PyObject *plain = PyTuple_New(NUM_FIELDS);
    if (plain == NULL) return NULL;
    for (int k = 0; k < NUM_FIELDS; k++) {
        PyObject *v = PyLong_FromLongLong(values[k]);
        if (v == NULL) {
            Py_DECREF(plain);
            return NULL;
        }
        PyTuple_SET_ITEM(plain, k, v);
    }
    PyObject *call_args = PyTuple_Pack(1, plain);
    Py_DECREF(plain);
    if (call_args == NULL) return NULL;
    PyObject *obj = PyTuple_Type.tp_new(tp, call_args, NULL);
    Py_DECREF(call_args);
    return obj;
#else
    /* What tuple's constructor does for a subclass: allocate the subclass, fill its items. */
    PyObject *obj = tp->tp_alloc(tp, NUM_FIELDS);
    if (obj == NULL) return NULL;
    for (int k = 0; k < NUM_FIELDS; k++) {
        PyObject *v = PyLong_FromLongLong(values[k]);
        if (v == NULL) {
            Py_DECREF(obj);
            return NULL;
        }
        PyTuple_SET_ITEM(obj, k, v);
    }
    return obj;
#endif
}

static int check_rank(BoardView *self, PyObject *arg, Py_ssize_t *rank) {
    Py_ssize_t r = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (r == -1 && PyErr_Occurred()) return -1;
    if (r < 0 || r >= self->n_slots) {
        PyErr_Format(PyExc_IndexError, "rank %zd is out of range: this board has %zd slots (ranks 0..%zd)", r,
                     self->n_slots, self->n_slots - 1);
        return -1;
    }
    *rank = r;
    return 0;
}

static int read_one(BoardView *self, PyObject *arg, int64_t *values) {
    Py_ssize_t r;
    if (check_rank(self, arg, &r) < 0) return -1;
    return read_slot(self->slots + r * SLOT_SIZE, values, self->max_retries, live_window(self->stale_after_ns));
}

static PyObject *view_read(BoardView *self, PyObject *arg) {
    int64_t values[NUM_FIELDS];
    int st = read_one(self, arg, values);
    if (st < 0) return NULL;
    if (st == ST_EMPTY || st == ST_TORN) Py_RETURN_NONE;
    return make_snapshot(self, values);
}

static PyObject *view_read_with_status(BoardView *self, PyObject *arg) {
    int64_t values[NUM_FIELDS];
    int st = read_one(self, arg, values);
    if (st < 0) return NULL;
    PyObject *snap;
    if (st == ST_EMPTY || st == ST_TORN) {
        snap = Py_None;
        Py_INCREF(snap);
    } else if ((snap = make_snapshot(self, values)) == NULL) {
        return NULL;
    }
    PyObject *status = PyTuple_GET_ITEM(self->statuses, st);
    PyObject *pair = PyTuple_Pack(2, status, snap);
    Py_DECREF(snap);
    return pair;
}

static PyObject *view_status(BoardView *self, PyObject *arg) {
    int64_t values[NUM_FIELDS];
    int st = read_one(self, arg, values);
    if (st < 0) return NULL;
    PyObject *status = PyTuple_GET_ITEM(self->statuses, st);
    Py_INCREF(status);
    return status;
}

static PyObject *view_read_all(BoardView *self, PyObject *unused) {
    int64_t values[NUM_FIELDS];
    LiveWindow live = live_window(self->stale_after_ns);
    PyObject *list = PyList_New(self->n_slots);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->n_slots; i++) {
        int st = read_slot(self->slots + i * SLOT_SIZE, values, self->max_retries, live);
        PyObject *item;
        if (st == ST_EMPTY || st == ST_TORN) {
            item = Py_None;
            Py_INCREF(item);
        } else if ((item = make_snapshot(self, values)) == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* read_detailed(rank) -> (SlotStatus, LoadSnapshot | None, bytes | None): fields and detail from one
   write; the detail is the DETAIL_SIZE bytes of a DETAIL_DTYPE record, None when the slot has none. */
static PyObject *view_read_detailed(BoardView *self, PyObject *arg) {
    int64_t values[NUM_FIELDS];
    uint64_t detail[DETAIL_WORDS];
    Py_ssize_t r;
    if (check_rank(self, arg, &r) < 0) return NULL;
    int st = read_slot_words(self->slots + r * SLOT_SIZE, values, detail, self->max_retries,
                             live_window(self->stale_after_ns));
    PyObject *snap, *raw;
    if (st == ST_EMPTY || st == ST_TORN) {
        snap = Py_NewRef(Py_None);
    } else if ((snap = make_snapshot(self, values)) == NULL) {
        return NULL;
    }
    if (snap == Py_None || !(detail[0] & DPB_DETAIL_PRESENT)) {
        raw = Py_NewRef(Py_None);
    } else if ((raw = PyBytes_FromStringAndSize((const char *)detail, DETAIL_SIZE)) == NULL) {
        Py_DECREF(snap);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(3, PyTuple_GET_ITEM(self->statuses, st), snap, raw);
    Py_DECREF(snap);
    Py_DECREF(raw);
    return out;
}

/* read_detailed_array(out) -> out: every slot as a DETAILED_DTYPE record (a read_array record, then
   the detail words), each from one write. `out` is the caller's: this path is for views, not dispatch. */
static PyObject *view_read_detailed_array(BoardView *self, PyObject *out) {
    Py_buffer buf;
    if (PyObject_GetBuffer(out, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (buf.len / DPB_DETAILED_RECORD_SIZE < self->n_slots || ((uintptr_t)buf.buf & 7) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "read_detailed_array(out) needs a C-contiguous, 8-byte aligned array of at least %zd "
                     "DETAILED_DTYPE records (%zd bytes), got %zd bytes",
                     self->n_slots, self->n_slots * (Py_ssize_t)DPB_DETAILED_RECORD_SIZE, buf.len);
        PyBuffer_Release(&buf);
        return NULL;
    }
    LiveWindow live = live_window(self->stale_after_ns);
    for (Py_ssize_t i = 0; i < self->n_slots; i++) {
        char *rec = (char *)buf.buf + i * DPB_DETAILED_RECORD_SIZE;
        int st = read_slot_words(self->slots + i * SLOT_SIZE, (int64_t *)rec, (uint64_t *)(rec + RECORD_SIZE),
                                 self->max_retries, live);
        if (st == ST_EMPTY || st == ST_TORN) ((int64_t *)rec)[F_DP_RANK] = i;
        memset(rec + RECORD_STATUS_OFFSET, 0, RECORD_SIZE - RECORD_STATUS_OFFSET);
        rec[RECORD_STATUS_OFFSET] = (char)st;
    }
    PyBuffer_Release(&buf);
    return Py_NewRef(out);
}

static PyMethodDef view_methods[] = {
    {"read_detailed", (PyCFunction)view_read_detailed, METH_O,
     "read_detailed(rank) -> (SlotStatus, LoadSnapshot | None, detail bytes | None), from one write"},
    {"read_detailed_array", (PyCFunction)view_read_detailed_array, METH_O,
     "read_detailed_array(out) -> out: every slot as a DETAILED_DTYPE record (fields, status, detail)"},
    {"read", (PyCFunction)view_read, METH_O, "read(rank) -> LoadSnapshot | None (None: empty or torn)"},
    {"read_with_status", (PyCFunction)view_read_with_status, METH_O,
     "read_with_status(rank) -> (SlotStatus, LoadSnapshot | None), from one consistent read"},
    {"status", (PyCFunction)view_status, METH_O, "status(rank) -> SlotStatus"},
    {"read_all", (PyCFunction)view_read_all, METH_NOARGS,
     "read_all() -> list[LoadSnapshot | None], index = rank"},
    {"read_array", (PyCFunction)(void (*)(void))view_read_array, METH_FASTCALL | METH_KEYWORDS,
     "read_array(out=None) -> the SNAPSHOT_DTYPE array, one record per slot.\n"
     "Without out, the reader's own array is filled and returned: it is overwritten by the next call."},
    {NULL}};

static PyMemberDef view_members[] = {
    {"max_retries", T_INT, offsetof(BoardView, max_retries), 0,
     "attempts per slot before it is reported TORN"},
    {"n_slots", T_PYSSIZET, offsetof(BoardView, n_slots), READONLY, "number of slots"},
    {NULL}};

static PyObject *view_get_stale_after_ns(BoardView *self, void *closure) {
    return PyLong_FromLongLong(self->stale_after_ns);
}

static int view_set_stale_after_ns(BoardView *self, PyObject *value, void *closure) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "stale_after_ns cannot be deleted");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (check_stale_after_ns(v) < 0) return -1;
    self->stale_after_ns = v;
    return 0;
}

static PyGetSetDef view_getset[] = {
    {"stale_after_ns", (getter)view_get_stale_after_ns, (setter)view_set_stale_after_ns,
     "a snapshot older than this, or stamped this far ahead of the reader's clock (monotonic ns), reads "
     "as STALE; in 1..1e15",
     NULL},
    {NULL}};

static PyTypeObject BoardViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpboard.board._seqlock.BoardView",
    .tp_basicsize = sizeof(BoardView),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Seqlocked reads of every slot of a board.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)view_init,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_methods = view_methods,
    .tp_members = view_members,
    .tp_getset = view_getset,
};

/* The owner word of the slot at `offset`: one aligned 64-bit value, so a reader never sees a new
   pid beside an old start time. */
static int owner_word_at(PyObject *mapping, Py_ssize_t offset, int writable, Py_buffer *view, uint64_t **word) {
    if (PyObject_GetBuffer(mapping, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (offset < 0 || offset % SLOT_SIZE != 0 || view->len < SLOT_SIZE || offset > view->len - SLOT_SIZE) {
        PyErr_Format(PyExc_ValueError, "slot offset %zd is outside the %zd-byte board mapping", offset, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    *word = (uint64_t *)((char *)view->buf + offset + OWNER_OFFSET);
    return 0;
}

/* slot_owner(mapping, offset) -> int: the slot's owner word (0: never claimed). */
static PyObject *mod_slot_owner(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "slot_owner(mapping, offset)");
        return NULL;
    }
    Py_ssize_t offset = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    uint64_t *word;
    if (owner_word_at(args[0], offset, 0, &view, &word) < 0) return NULL;
    uint64_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(v);
}

/* claim_slot(mapping, offset, expected, new) -> bool: store `new` into the owner word if it still
   holds `expected` (compare-and-swap); False when another process changed it first. */
static PyObject *mod_claim_slot(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "claim_slot(mapping, offset, expected, new)");
        return NULL;
    }
    Py_ssize_t offset = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    unsigned long long expected = PyLong_AsUnsignedLongLong(args[2]);
    if (expected == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long desired = PyLong_AsUnsignedLongLong(args[3]);
    if (desired == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    uint64_t *word;
    if (owner_word_at(args[0], offset, 1, &view, &word) < 0) return NULL;
    uint64_t exp = expected;
    int won = __atomic_compare_exchange_n(word, &exp, (uint64_t)desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyBool_FromLong(won);
}

/* ------------------------------------------------------------------------------------------- */
/* The rows of the side records (dpboard.board.side_record): the same seqlock, over a row of any */
/* size whose first word is its sequence.                                                       */

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* an export of the record's mapping: keeps it mapped while this row lives */
    int has_view;
    uint64_t *row;
    Py_ssize_t words;
    uint64_t odd; /* the odd sequence of the write under way; 0: none */
} SeqRow;

static void seqrow_release_view(SeqRow *self) {
    self->row = NULL;
    self->odd = 0;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
}

static void seqrow_dealloc(SeqRow *self) {
    seqrow_release_view(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A row's place in a buffer: `offset` and `size` 8-byte multiples, the rows inside it. */
static int row_span(Py_buffer *view, Py_ssize_t offset, Py_ssize_t size, Py_ssize_t rows) {
    if (offset < 0 || size < 8 || rows < 0 || offset % 8 || size % 8 || ((uintptr_t)view->buf & 7) ||
        (rows > 0 && (size > PY_SSIZE_T_MAX / rows || offset > view->len - size * rows))) {
        PyErr_Format(PyExc_ValueError,
                     "%zd rows of %zd bytes at offset %zd do not fit the %zd-byte mapping (offset and row size "
                     "must be multiples of 8)",
                     rows, size, offset, view->len);
        return -1;
    }
    return 0;
}

/* SeqRow(mapping, offset, size) */
static int seqrow_init(SeqRow *self, PyObject *args, PyObject *kwds) {
    PyObject *mapping;
    Py_ssize_t offset, size;
    static char *kwlist[] = {"mapping", "offset", "size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn", kwlist, &mapping, &offset, &size)) return -1;
    seqrow_release_view(self);
    if (PyObject_GetBuffer(mapping, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->has_view = 1;
    if (row_span(&self->view, offset, size, 1) < 0) {
        seqrow_release_view(self);
        return -1;
    }
    self->row = (uint64_t *)((char *)self->view.buf + offset);
    self->words = size / 8;
    return 0;
}

static inline int seqrow_open(SeqRow *self) {
    if (self->row != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "this row was released with its record: open the record again to write");
    return -1;
}

/* begin(): the row's sequence odd (kept odd when a dead writer left it so), then [W1]. */
static PyObject *seqrow_begin(SeqRow *self, PyObject *unused) {
    if (seqrow_open(self) < 0) return NULL;
    if (self->odd == 0) self->odd = dpb_seq_begin(self->row);
    Py_RETURN_NONE;
}

/* end(): [W2], the row even again; the stores since begin() are one whole write. */
static PyObject *seqrow_end(SeqRow *self, PyObject *unused) {
    if (seqrow_open(self) < 0) return NULL;
    if (self->odd == 0) {
        PyErr_SetString(PyExc_RuntimeError, "SeqRow.end() without begin()");
        return NULL;
    }
    dpb_seq_close(self->row, self->odd);
    self->odd = 0;
    Py_RETURN_NONE;
}

/* add(word, a, b): words `word` and `word + 1` of the row grow by a and b, as one write. */
static PyObject *seqrow_add(SeqRow *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add(word, a, b)");
        return NULL;
    }
    if (seqrow_open(self) < 0) return NULL;
    Py_ssize_t word = PyNumber_AsSsize_t(args[0], PyExc_OverflowError);
    if (word == -1 && PyErr_Occurred()) return NULL;
    long long a = PyLong_AsLongLong(args[1]);
    if (a == -1 && PyErr_Occurred()) return NULL;
    long long b = PyLong_AsLongLong(args[2]);
    if (b == -1 && PyErr_Occurred()) return NULL;
    /* word + 1 would overflow for word = PY_SSIZE_T_MAX and pass: compare against words - 2 instead
       (words >= 1, row_span holds it). */
    if (word < 1 || word > self->words - 2) {
        PyErr_Format(PyExc_IndexError,
                     "word %zd and the next are not data words of this %zd-word row: add(word, a, b) takes word "
                     "in 1..%zd",
                     word, self->words, self->words - 2);
        return NULL;
    }
    uint64_t *w = self->row + word;
    /* Only this writer stores these words: plain reads of them, atomic stores for the readers. */
    uint64_t va = __atomic_load_n(&w[0], __ATOMIC_RELAXED) + (uint64_t)a;
    uint64_t vb = __atomic_load_n(&w[1], __ATOMIC_RELAXED) + (uint64_t)b;
    uint64_t odd = self->odd ? self->odd : dpb_seq_begin(self->row);
    __atomic_store_n(&w[0], va, __ATOMIC_RELAXED);
    __atomic_store_n(&w[1], vb, __ATOMIC_RELAXED);
    if (self->odd == 0) dpb_seq_close(self->row, odd);
    Py_RETURN_NONE;
}

static PyObject *seqrow_release(SeqRow *self, PyObject *unused) {
    seqrow_release_view(self);
    Py_RETURN_NONE;
}

static PyObject *seqrow_get_sequence(SeqRow *self, void *closure) {
    if (seqrow_open(self) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(self->row, __ATOMIC_ACQUIRE));
}

static PyMethodDef seqrow_methods[] = {
    {"begin", (PyCFunction)seqrow_begin, METH_NOARGS,
     "begin(): open a write (the sequence odd, then a release fence); the stores until end() are one write"},
    {"end", (PyCFunction)seqrow_end, METH_NOARGS, "end(): close the write (the sequence even, a release store)"},
    {"add", (PyCFunction)(void (*)(void))seqrow_add, METH_FASTCALL,
     "add(word, a, b): words word and word + 1 grow by a and b, as one write (or inside begin/end)"},
    {"release", (PyCFunction)seqrow_release, METH_NOARGS, "release(): let go of the mapping; later writes raise"},
    {NULL}};

static PyGetSetDef seqrow_getset[] = {
    {"sequence", (getter)seqrow_get_sequence, NULL, "the row's sequence word (odd: a write is under way)", NULL},
    {NULL}};

static PyTypeObject SeqRowType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpboard.board._seqlock.SeqRow",
    .tp_basicsize = sizeof(SeqRow),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The writer of one seqlocked row of a side record (dpb_seqlock.h): begin(), stores, end().",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)seqrow_init,
    .tp_dealloc = (destructor)seqrow_dealloc,
    .tp_methods = seqrow_methods,
    .tp_getset = seqrow_getset,
};

/* read_rows(mapping, offset, row_size, rows, out, whole, max_retries) -> number of torn rows.
   Copies `rows` rows of `row_size` bytes from `offset` of the mapping (read-only is enough) into
   `out`, each from one whole write; whole[i] (one byte per row, or None) says which were. A torn
   row's bytes in `out` are its last attempt's, or left as they were. */
static PyObject *mod_read_rows(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "read_rows(mapping, offset, row_size, rows, out, whole, max_retries)");
        return NULL;
    }
    Py_ssize_t nums[3];
    for (int k = 0; k < 3; k++) {
        nums[k] = PyNumber_AsSsize_t(args[1 + k], PyExc_OverflowError);
        if (nums[k] == -1 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t offset = nums[0], size = nums[1], rows = nums[2];
    long max_retries = PyLong_AsLong(args[6]);
    if (max_retries == -1 && PyErr_Occurred()) return NULL;
    if (max_retries < 1 || max_retries > 1000000) {
        PyErr_Format(PyExc_ValueError, "max_retries must be in 1..1000000, got %ld", max_retries);
        return NULL;
    }
    Py_buffer src, out, whole;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[4], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int has_whole = args[5] != Py_None;
    if (has_whole && PyObject_GetBuffer(args[5], &whole, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (row_span(&src, offset, size, rows) < 0) goto done;
    if (out.len < size * rows || ((uintptr_t)out.buf & 7) || (has_whole && whole.len < rows)) {
        PyErr_Format(PyExc_ValueError,
                     "read_rows needs an 8-byte aligned out of at least %zd bytes and a whole of at least %zd, "
                     "got %zd and %zd",
                     size * rows, rows, out.len, has_whole ? whole.len : (Py_ssize_t)-1);
        goto done;
    }
    Py_ssize_t torn = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        int ok = dpb_read_row((const uint64_t *)((const char *)src.buf + offset + i * size),
                              (uint64_t *)((char *)out.buf + i * size), (size_t)(size / 8), (int)max_retries);
        torn += !ok;
        if (has_whole) ((char *)whole.buf)[i] = (char)ok;
    }
    result = PyLong_FromSsize_t(torn);
done:
    if (has_whole) PyBuffer_Release(&whole);
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef module_methods[] = {
    {"read_rows", (PyCFunction)(void (*)(void))mod_read_rows, METH_FASTCALL,
     "read_rows(mapping, offset, row_size, rows, out, whole, max_retries) -> rows torn; each copied whole"},
    {"slot_owner", (PyCFunction)(void (*)(void))mod_slot_owner, METH_FASTCALL,
     "slot_owner(mapping, offset) -> the slot's owner word (0: never claimed)"},
    {"claim_slot", (PyCFunction)(void (*)(void))mod_claim_slot, METH_FASTCALL,
     "claim_slot(mapping, offset, expected, new) -> True if the owner word went from expected to new"},
    {NULL}};

static struct PyModuleDef seqlock_module = {
    PyModuleDef_HEAD_INIT, "dpboard.board._seqlock", "Seqlocked slot writer and board reader (see the source).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__seqlock(void) {
    if (PyType_Ready(&SlotWriterType) < 0 || PyType_Ready(&BoardViewType) < 0 || PyType_Ready(&SeqRowType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&seqlock_module);
    if (m == NULL) return NULL;
    Py_INCREF(&SlotWriterType);
    Py_INCREF(&BoardViewType);
    Py_INCREF(&SeqRowType);
    if (PyModule_AddObject(m, "SlotWriter", (PyObject *)&SlotWriterType) < 0 ||
        PyModule_AddObject(m, "BoardView", (PyObject *)&BoardViewType) < 0 ||
        PyModule_AddObject(m, "SeqRow", (PyObject *)&SeqRowType) < 0 ||
        /* The layout this extension was compiled with: dpboard.board compares it with snapshot.py. */
        PyModule_AddIntConstant(m, "LAYOUT_VERSION", DPB_LAYOUT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", DPB_HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "SLOT_SIZE", DPB_SLOT_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "FIELDS_OFFSET", DPB_FIELDS_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "NUM_FIELDS", DPB_NUM_FIELDS) < 0 ||
        PyModule_AddIntConstant(m, "OWNER_OFFSET", DPB_OWNER_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "OWNER_PID_BITS", DPB_OWNER_PID_BITS) < 0 ||
        PyModule_AddIntConstant(m, "RECORD_SIZE", DPB_RECORD_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "RECORD_STATUS_OFFSET", DPB_RECORD_STATUS_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "DETAIL_OFFSET", DPB_DETAIL_OFFSET) < 0 ||
        PyModule_AddIntConstant(m, "DETAIL_SIZE", DPB_DETAIL_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
