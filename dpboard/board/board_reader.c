/*
 * board_reader.c: BoardView, the seqlocked reads of every slot of a board (dpboard.board._seqlock;
 * board_module.h lists the module's files).
 *
 * Any number of readers, in any process that maps the board. Each read copies a slot's fields (a
 * dispatch read) or fields and detail (a detailed read) from one whole write (dpb_seqlock.h), gives
 * up after max_retries attempts and reports the slot TORN, and says LIVE or STALE by the writer's
 * monotonic stamp.
 */
#include "board_module.h"

#include <structmember.h>

#include "dpb_seqlock.h"

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

PyTypeObject BoardViewType = {
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
