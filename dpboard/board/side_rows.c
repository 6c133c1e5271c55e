/*
 * side_rows.c: the rows of the side records (dpboard.board.side_record: the sent and dispatch
 * records), the board's seqlock (dpb_seqlock.h) over a row of any size whose first word is its
 * sequence: SeqRow writes one row, read_rows copies rows whole (dpboard.board._seqlock;
 * board_module.h lists the module's files).
 */
#include "board_module.h"

#include "dpb_seqlock.h"

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
    dpb_store_word(&w[0], va);
    dpb_store_word(&w[1], vb);
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

PyTypeObject SeqRowType = {
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

PyMethodDef side_rows_functions[] = {
    {"read_rows", (PyCFunction)(void (*)(void))mod_read_rows, METH_FASTCALL,
     "read_rows(mapping, offset, row_size, rows, out, whole, max_retries) -> rows torn; each copied whole"},
    {NULL}};
