/*
 * claim.c: a slot's owner word (dpboard.board._seqlock; board_module.h lists the module's files):
 * pid and process start time in one 64-bit value, outside the seqlock, claimed with a
 * compare-and-swap, so two would-be writers racing for a slot cannot both win.
 */
#include "board_module.h"

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

PyMethodDef claim_functions[] = {
    {"slot_owner", (PyCFunction)(void (*)(void))mod_slot_owner, METH_FASTCALL,
     "slot_owner(mapping, offset) -> the slot's owner word (0: never claimed)"},
    {"claim_slot", (PyCFunction)(void (*)(void))mod_claim_slot, METH_FASTCALL,
     "claim_slot(mapping, offset, expected, new) -> True if the owner word went from expected to new"},
    {NULL}};
