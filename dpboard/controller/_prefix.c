/*
 * dpboard.controller._prefix: chained hashes of a prompt's token blocks, without Python ints.
 *
 * The cache-aware dispatch method asks, per request, how many of its prompt blocks each rank
 * probably holds (dpboard/controller/prefix_index.py). That needs one hash per block of
 * `block_size` tokens, chained so that a block's hash covers the whole prefix up to its end: equal
 * hashes mean equal prefixes, as in a radix cache. The controller receives the prompt as a msgpack
 * frame; decoding its `input_ids` into a Python list already costs the controller tens of
 * microseconds for a long prompt, so the hashes come straight from the frame's bytes here
 * (hash_frame_blocks), or from a sequence of ints without creating any object per token
 * (hash_token_blocks). prefix_index.block_hashes_py is the same function in Python, the oracle.
 *
 * The hash: per token v (as a 64-bit two's-complement value), h = (h ^ v) * K; h ^= h >> 32;
 * at the end of each whole block the running h is finalised with the splitmix64 avalanche and
 * becomes the block's hash, and the next block continues from it (the chain). A trailing partial
 * block gets no hash: a cache holds whole pages. 64 bits: a collision among a cluster's blocks is
 * vanishingly rare, and the index is an estimate anyway.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define K_MUL 0x9E3779B97F4A7C15ULL
#define SEED 0x243F6A8885A308D3ULL
#define MAX_DEPTH 32 /* nesting of msgpack values skipped on the way to input_ids */

static inline uint64_t step(uint64_t h, uint64_t v) {
    h = (h ^ v) * K_MUL;
    return h ^ (h >> 32);
}

static inline uint64_t finish(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The running state of one prompt's hashing. */
typedef struct {
    uint64_t h;
    Py_ssize_t in_block, block_size, n_blocks, cap;
    uint64_t *out;
} Chain;

static inline void chain_token(Chain *c, uint64_t v) {
    c->h = step(c->h, v);
    if (++c->in_block == c->block_size) {
        c->h = finish(c->h);
        if (c->n_blocks < c->cap) c->out[c->n_blocks] = c->h;
        c->n_blocks++;
        c->in_block = 0;
    }
}

/* The result: a bytes object of n_blocks uint64 hashes in this machine's byte order
   (memoryview(...).cast("Q") reads it). */
static PyObject *chain_result(Chain *c) {
    return PyBytes_FromStringAndSize((const char *)c->out, c->n_blocks * (Py_ssize_t)sizeof(uint64_t));
}

static int check_block_size(Py_ssize_t block_size) {
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1 token, got %zd", block_size);
        return -1;
    }
    return 0;
}

/* hash_token_blocks(ids, block_size) -> bytes: ids is any sequence of ints (a list from a decoded
   frame, a tuple, an array). */
static PyObject *hash_token_blocks(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hash_token_blocks(ids, block_size)");
        return NULL;
    }
    Py_ssize_t block_size = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if ((block_size == -1 && PyErr_Occurred()) || check_block_size(block_size) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "input_ids must be a sequence of token ids");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Chain c = {SEED, 0, block_size, 0, n / block_size, NULL};
    c.out = PyMem_Malloc((c.cap > 0 ? c.cap : 1) * sizeof(uint64_t));
    if (c.out == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < c.cap * block_size; i++) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if ((v == -1 && PyErr_Occurred()) || overflow) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "input_ids[%zd] is not a 64-bit integer token id: %R", i, items[i]);
            }
            PyMem_Free(c.out);
            Py_DECREF(seq);
            return NULL;
        }
        chain_token(&c, (uint64_t)v);
    }
    PyObject *res = chain_result(&c);
    PyMem_Free(c.out);
    Py_DECREF(seq);
    return res;
}

/* -- msgpack, just enough to find and read input_ids ----------------------------------------- */

typedef struct {
    const uint8_t *p, *end;
} Cursor;

static inline int need(Cursor *r, Py_ssize_t n) { return r->end - r->p >= n ? 0 : -1; }

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Reads an integer (any msgpack int encoding) into *v; -1 if the next value is not an int. */
static int read_int(Cursor *r, int64_t *v) {
    if (need(r, 1) < 0) return -1;
    uint8_t t = *r->p++;
    if (t <= 0x7f) { *v = t; return 0; }
    if (t >= 0xe0) { *v = (int8_t)t; return 0; }
    static const int width[] = {1, 2, 4, 8}; /* 0xcc..0xcf uint, 0xd0..0xd3 int */
    if (t >= 0xcc && t <= 0xd3) {
        int n = width[(t - 0xcc) & 3];
        if (need(r, n) < 0) return -1;
        uint64_t u = be(r->p, n);
        r->p += n;
        if (t <= 0xcf) {
            if (u > (uint64_t)INT64_MAX) return -1;
            *v = (int64_t)u;
        } else {
            int shift = 64 - 8 * n; /* sign-extend */
            *v = (int64_t)(u << shift) >> shift;
        }
        return 0;
    }
    return -1;
}

/* Reads a map or array header: its count into *n; -1 if the next value is neither of `kind`. */
static int read_header(Cursor *r, int is_map, Py_ssize_t *n) {
    if (need(r, 1) < 0) return -1;
    uint8_t t = *r->p;
    uint8_t fix_lo = is_map ? 0x80 : 0x90, b16 = is_map ? 0xde : 0xdc, b32 = is_map ? 0xdf : 0xdd;
    if (t >= fix_lo && t <= fix_lo + 0x0f) { r->p++; *n = t & 0x0f; return 0; }
    if (t == b16 || t == b32) {
        int w = t == b16 ? 2 : 4;
        if (need(r, 1 + w) < 0) return -1;
        *n = (Py_ssize_t)be(r->p + 1, w);
        r->p += 1 + w;
        return 0;
    }
    return -1;
}

/* Skips one value of any kind; -1 on a malformed or too deeply nested frame. */
static int skip(Cursor *r, int depth) {
    if (depth > MAX_DEPTH || need(r, 1) < 0) return -1;
    uint8_t t = *r->p;
    int64_t ignored;
    Py_ssize_t n;
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3)) return read_int(r, &ignored);
    if (t == 0xc0 || t == 0xc2 || t == 0xc3) { r->p++; return 0; } /* nil, false, true */
    if (t == 0xca || t == 0xcb) { /* float32, float64 */
        int w = t == 0xca ? 4 : 8;
        if (need(r, 1 + w) < 0) return -1;
        r->p += 1 + w;
        return 0;
    }
    if ((t >= 0xa0 && t <= 0xbf) || t == 0xd9 || t == 0xda || t == 0xdb || t == 0xc4 || t == 0xc5 || t == 0xc6) {
        Py_ssize_t len, head;
        if (t >= 0xa0 && t <= 0xbf) { len = t & 0x1f; head = 1; }
        else {
            int w = (t == 0xd9 || t == 0xc4) ? 1 : (t == 0xda || t == 0xc5) ? 2 : 4;
            if (need(r, 1 + w) < 0) return -1;
            len = (Py_ssize_t)be(r->p + 1, w);
            head = 1 + w;
        }
        if (need(r, head + len) < 0) return -1;
        r->p += head + len;
        return 0;
    }
    if ((t >= 0xd4 && t <= 0xd8) || t == 0xc7 || t == 0xc8 || t == 0xc9) { /* ext */
        Py_ssize_t len, head;
        if (t >= 0xd4 && t <= 0xd8) { len = 1 + ((Py_ssize_t)1 << (t - 0xd4)); head = 1; }
        else {
            int w = t == 0xc7 ? 1 : t == 0xc8 ? 2 : 4;
            if (need(r, 1 + w) < 0) return -1;
            len = 1 + (Py_ssize_t)be(r->p + 1, w);
            head = 1 + w;
        }
        if (need(r, head + len) < 0) return -1;
        r->p += head + len;
        return 0;
    }
    if (read_header(r, 0, &n) == 0) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (skip(r, depth + 1) < 0) return -1;
        return 0;
    }
    if (read_header(r, 1, &n) == 0) {
        for (Py_ssize_t i = 0; i < 2 * n; i++)
            if (skip(r, depth + 1) < 0) return -1;
        return 0;
    }
    return -1;
}

/* 1 if the next value is the string `key` (consumed), 0 if another value (not consumed), -1 bad. */
static int is_key(Cursor *r, const char *key, Py_ssize_t key_len) {
    if (need(r, 1) < 0) return -1;
    uint8_t t = *r->p;
    Py_ssize_t len, head;
    if (t >= 0xa0 && t <= 0xbf) { len = t & 0x1f; head = 1; }
    else if (t == 0xd9) {
        if (need(r, 2) < 0) return -1;
        len = r->p[1];
        head = 2;
    } else {
        return 0;
    }
    if (need(r, head + len) < 0) return -1;
    if (len == key_len && memcmp(r->p + head, key, key_len) == 0) {
        r->p += head + len;
        return 1;
    }
    return 0;
}

/* hash_frame_blocks(frame, block_size) -> (num_tokens, bytes) | None: the frame is a msgpack map;
   None when it has no input_ids (or they are nil). ValueError names what is malformed. */
static PyObject *hash_frame_blocks(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hash_frame_blocks(frame, block_size)");
        return NULL;
    }
    Py_ssize_t block_size = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if ((block_size == -1 && PyErr_Occurred()) || check_block_size(block_size) < 0) return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    Cursor r = {(const uint8_t *)buf.buf, (const uint8_t *)buf.buf + buf.len};
    Py_ssize_t n_keys, n_ids = -1;
    PyObject *res = NULL;
    const char *bad = NULL;
    if (read_header(&r, 1, &n_keys) < 0) {
        bad = "the frame is not a msgpack map";
        goto done;
    }
    for (Py_ssize_t k = 0; k < n_keys; k++) {
        int found = is_key(&r, "input_ids", 9);
        if (found < 0) { bad = "truncated key"; goto done; }
        if (!found) {
            if (skip(&r, 1) < 0 || skip(&r, 1) < 0) { bad = "malformed map entry"; goto done; }
            continue;
        }
        if (need(&r, 1) == 0 && *r.p == 0xc0) break; /* input_ids: nil */
        if (read_header(&r, 0, &n_ids) < 0) { bad = "input_ids is not an array"; goto done; }
        break;
    }
    if (n_ids < 0) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    {
        Chain c = {SEED, 0, block_size, 0, n_ids / block_size, NULL};
        c.out = PyMem_Malloc((c.cap > 0 ? c.cap : 1) * sizeof(uint64_t));
        if (c.out == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < n_ids; i++) {
            int64_t v;
            if (read_int(&r, &v) < 0) {
                PyMem_Free(c.out);
                PyErr_Format(PyExc_ValueError, "input_ids[%zd] is not an integer that fits 64 bits", i);
                goto done;
            }
            if (i < c.cap * block_size) chain_token(&c, (uint64_t)v);
        }
        PyObject *hashes = chain_result(&c);
        PyMem_Free(c.out);
        if (hashes != NULL) {
            res = Py_BuildValue("(nN)", n_ids, hashes);
        }
    }
done:
    PyBuffer_Release(&buf);
    if (bad != NULL) PyErr_Format(PyExc_ValueError, "cannot read input_ids: %s", bad);
    return res;
}

static PyMethodDef prefix_methods[] = {
    {"hash_token_blocks", (PyCFunction)(void (*)(void))hash_token_blocks, METH_FASTCALL,
     "hash_token_blocks(ids, block_size) -> bytes of native uint64 chained block hashes"},
    {"hash_frame_blocks", (PyCFunction)(void (*)(void))hash_frame_blocks, METH_FASTCALL,
     "hash_frame_blocks(frame, block_size) -> (num_tokens, hashes) from a msgpack request frame, or None"},
    {NULL}};

static struct PyModuleDef prefix_module = {
    PyModuleDef_HEAD_INIT, "dpboard.controller._prefix", "Chained prompt block hashes (see the source).", -1,
    prefix_methods,
};

PyMODINIT_FUNC PyInit__prefix(void) { return PyModule_Create(&prefix_module); }
