/*
 * slot_writer.c: SlotWriter, the one writer of a board slot (dpboard.board._seqlock; board_module.h
 * lists the module's files).
 *
 * A slot is a 64-bit sequence word, then the int64 fields of a LoadSnapshot, then the owner word
 * and a reserved word, then the detail words (an engine's whole snapshot beyond the dispatch fields;
 * docs/FORMAT.md; the offsets come from dpboard_layout.h). One sequence covers fields and detail,
 * written with the seqlock of dpb_seqlock.h. One writer per slot (claim.c's owner word, the caller's
 * lock); it keeps the slot's sequence in local_seq (always even). A writer killed between its two
 * sequence stores leaves the slot odd; the next writer of that slot starts from the odd value
 * rounded up, so its first publish makes the slot whole again.
 */
#include "board_module.h"

#include <structmember.h>

#include "dpb_seqlock.h"

static const char *const FIELD_NAMES[NUM_FIELDS] = {DPB_FIELD_NAMES_INIT};

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
        dpb_store_word(&words[0], 0);
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
    dpb_store_words((uint64_t *)fields, (const uint64_t *)values, NUM_FIELDS / 2);
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    Py_BEGIN_ALLOW_THREADS nanosleep(&ts, NULL);
    Py_END_ALLOW_THREADS
    dpb_store_words((uint64_t *)fields + NUM_FIELDS / 2, (const uint64_t *)values + NUM_FIELDS / 2,
                    NUM_FIELDS - NUM_FIELDS / 2);
    dpb_store_word((uint64_t *)(self->slot + DETAIL_OFFSET), 0);
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
    dpb_store_word((uint64_t *)&fields[F_MONOTONIC_NS], 0);
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

PyTypeObject SlotWriterType = {
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
