/*
 * board_module.c: the extension module dpboard.board._seqlock, one module built from the files
 * board_module.h lists: the slot writer (slot_writer.c), the board reader (board_reader.c), the side
 * records' rows (side_rows.c) and the owner claim (claim.c), over the one seqlock of dpb_seqlock.h.
 * It also exports the layout it was compiled with, which dpboard.board compares with snapshot.py.
 */
#include "board_module.h"

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

static struct PyModuleDef seqlock_module = {
    PyModuleDef_HEAD_INIT, "dpboard.board._seqlock", "Seqlocked slot writer and board reader (see the source).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__seqlock(void) {
    if (PyType_Ready(&SlotWriterType) < 0 || PyType_Ready(&BoardViewType) < 0 || PyType_Ready(&SeqRowType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&seqlock_module);
    if (m == NULL) return NULL;
    if (PyModule_AddFunctions(m, side_rows_functions) < 0 || PyModule_AddFunctions(m, claim_functions) < 0) {
        Py_DECREF(m);
        return NULL;
    }
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
