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
#define MAX_DEPTH 64 /* nesting of the msgpack values a request frame skips; deeper is malformed */

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
    Chain c = {SEED, 0, block_size, 0, n / block_size, NULL};
    c.out = PyMem_Malloc((c.cap > 0 ? c.cap : 1) * sizeof(uint64_t));
    if (c.out == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < c.cap * block_size; i++) {
        /* An element that is not an exact int runs Python code (__index__) that may shrink the list
           being read: its length and items are read again each step, and the item held meanwhile. */
        if (i >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_Format(PyExc_ValueError, "input_ids changed while it was read (%zd of %zd tokens left)",
                         PySequence_Fast_GET_SIZE(seq), n);
            PyMem_Free(c.out);
            Py_DECREF(seq);
            return NULL;
        }
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if ((v == -1 && PyErr_Occurred()) || overflow) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "input_ids[%zd] is not a 64-bit integer token id: %R", i, item);
            }
            Py_DECREF(item);
            PyMem_Free(c.out);
            Py_DECREF(seq);
            return NULL;
        }
        Py_DECREF(item);
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

/* The Python type msgpack decodes a value of first byte t into, for messages. */
static const char *kind_name(uint8_t t) {
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3)) return "int";
    if (t >= 0x80 && t <= 0x8f) return "dict";
    if (t >= 0x90 && t <= 0x9f) return "list";
    if ((t >= 0xa0 && t <= 0xbf) || (t >= 0xd9 && t <= 0xdb)) return "str";
    switch (t) {
    case 0xc0: return "NoneType";
    case 0xc2: case 0xc3: return "bool";
    case 0xc4: case 0xc5: case 0xc6: return "bytes";
    case 0xca: case 0xcb: return "float";
    case 0xdc: case 0xdd: return "list";
    case 0xde: case 0xdf: return "dict";
    case 0xc1: return "invalid byte 0xc1";
    default: return "ExtType";
    }
}

/* The string at the cursor, consumed: its bytes in *s, *len; -1 (nothing consumed) if not a str. */
static int read_str(Cursor *r, const char **s, Py_ssize_t *len) {
    if (need(r, 1) < 0) return -1;
    uint8_t t = *r->p;
    Py_ssize_t head;
    if (t >= 0xa0 && t <= 0xbf) { *len = t & 0x1f; head = 1; }
    else if (t == 0xd9 || t == 0xda || t == 0xdb) {
        int w = t == 0xd9 ? 1 : t == 0xda ? 2 : 4;
        if (need(r, 1 + w) < 0) return -1;
        *len = (Py_ssize_t)be(r->p + 1, w);
        head = 1 + w;
    } else {
        return -1;
    }
    if (need(r, head + *len) < 0) return -1;
    *s = (const char *)r->p + head;
    r->p += head + *len;
    return 0;
}

/* Any msgpack int at the cursor as a Python int (uint64 included), consumed; NULL if not an int. */
static PyObject *read_pyint(Cursor *r) {
    if (need(r, 1) < 0) return NULL;
    if (*r->p == 0xcf) {
        if (need(r, 9) < 0) return NULL;
        uint64_t u = be(r->p + 1, 8);
        r->p += 9;
        return PyLong_FromUnsignedLongLong(u);
    }
    int64_t v;
    const uint8_t *at = r->p;
    if (read_int(r, &v) < 0) {
        r->p = at;
        return NULL;
    }
    return PyLong_FromLongLong(v);
}

/* What the controller reads of a request frame. New references, NULL while absent. */
typedef struct {
    PyObject *rid, *num_tokens, *routed, *room, *hashes;
    Py_ssize_t n_ids; /* -1: no input_ids (absent or nil) */
} Request;

static void request_clear(Request *q) {
    Py_CLEAR(q->rid);
    Py_CLEAR(q->num_tokens);
    Py_CLEAR(q->routed);
    Py_CLEAR(q->room);
    Py_CLEAR(q->hashes);
}

static int bad(const char *message) {
    PyErr_SetString(PyExc_ValueError, message);
    return -1;
}

/* input_ids: nil, or an array of ints (each within 64 bits); hashed when block_size > 0. */
static int read_ids(Cursor *r, Request *q, Py_ssize_t block_size) {
    Py_CLEAR(q->hashes);
    q->n_ids = -1;
    if (*r->p == 0xc0) { r->p++; return 0; }
    Py_ssize_t n;
    if (read_header(r, 0, &n) < 0) {
        PyErr_Format(PyExc_ValueError, "input_ids must be a list, got %s", kind_name(*r->p));
        return -1;
    }
    if (n > r->end - r->p) /* every int takes a byte at least: a count the frame cannot hold is a lie */
        return bad("input_ids claims more elements than the frame holds");
    Py_ssize_t bs = block_size > 0 ? block_size : 1;
    Chain c = {SEED, 0, bs, 0, block_size > 0 ? n / bs : 0, NULL};
    c.out = PyMem_Malloc((c.cap > 0 ? c.cap : 1) * sizeof(uint64_t));
    if (c.out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        if (read_int(r, &v) < 0) {
            PyMem_Free(c.out);
            PyErr_Format(PyExc_ValueError, "input_ids[%zd] is not an integer that fits 64 bits", i);
            return -1;
        }
        if (i < c.cap * bs) chain_token(&c, (uint64_t)v);
    }
    if (block_size > 0) {
        q->hashes = chain_result(&c);
        if (q->hashes == NULL) {
            PyMem_Free(c.out);
            return -1;
        }
    }
    PyMem_Free(c.out);
    q->n_ids = n;
    return 0;
}

/* An optional int (routed_dp_rank, bootstrap_room): nil or an int. */
static int read_optional_int(Cursor *r, PyObject **slot, const char *key) {
    Py_CLEAR(*slot);
    if (*r->p == 0xc0) {
        r->p++;
        *slot = Py_NewRef(Py_None);
        return 0;
    }
    uint8_t t = *r->p;
    *slot = read_pyint(r);
    if (*slot == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s must be an int or nil, got %s", key, kind_name(t));
        return -1;
    }
    return 0;
}

/* The one parse of a request frame: a msgpack map whose keys rid, input_ids, num_tokens,
   routed_dp_rank and bootstrap_room are read (the last of a repeated key counts, as msgpack's
   own decoder does), every other entry skipped without building anything; a value nested deeper
   than MAX_DEPTH, or bytes after the map, make the frame malformed. No object per token: a frame
   whose input_ids holds anything but ints fails at the first such element. */
static int parse_request(const uint8_t *p, Py_ssize_t len, Py_ssize_t block_size, Request *q) {
    Cursor r = {p, p + len};
    Py_ssize_t n_keys;
    q->n_ids = -1;
    if (need(&r, 1) < 0) return bad("not msgpack (empty frame)");
    if (read_header(&r, 1, &n_keys) < 0) {
        PyErr_Format(PyExc_ValueError, "not a map but %s", kind_name(*r.p));
        return -1;
    }
    for (Py_ssize_t k = 0; k < n_keys; k++) {
        const char *key;
        Py_ssize_t key_len;
        if (need(&r, 1) < 0) return bad("not msgpack (truncated map)");
        if (read_str(&r, &key, &key_len) < 0) { /* a key of another type: not one of ours */
            if (skip(&r, 1) < 0 || skip(&r, 1) < 0) return bad("not msgpack (malformed or nested too deeply)");
            continue;
        }
        if (need(&r, 1) < 0) return bad("not msgpack (truncated map)");
#define KEY(lit) (key_len == (Py_ssize_t)sizeof(lit) - 1 && memcmp(key, lit, sizeof(lit) - 1) == 0)
        if (KEY("rid")) {
            const char *s;
            Py_ssize_t n;
            uint8_t t = *r.p;
            Py_CLEAR(q->rid);
            if (read_str(&r, &s, &n) == 0) {
                q->rid = PyUnicode_DecodeUTF8(s, n, "strict");
                if (q->rid == NULL) {
                    PyErr_Clear();
                    return bad("rid is not valid UTF-8");
                }
            } else if (strcmp(kind_name(t), "str") == 0) {
                return bad("not msgpack (truncated string)");
            } else if ((q->rid = read_pyint(&r)) == NULL) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "rid must be a string or int, got %s", kind_name(t));
                return -1;
            }
        } else if (KEY("input_ids")) {
            if (read_ids(&r, q, block_size) < 0) return -1;
        } else if (KEY("num_tokens")) {
            Py_CLEAR(q->num_tokens);
            const uint8_t *at = r.p;
            q->num_tokens = read_pyint(&r);
            if (q->num_tokens == NULL) {
                if (PyErr_Occurred()) return -1;
                r.p = at; /* not an int: the caller says what a request needs */
                if (skip(&r, 1) < 0) return bad("not msgpack (malformed or nested too deeply)");
            }
        } else if (KEY("routed_dp_rank")) {
            if (read_optional_int(&r, &q->routed, "routed_dp_rank") < 0) return -1;
        } else if (KEY("bootstrap_room")) {
            if (read_optional_int(&r, &q->room, "bootstrap_room") < 0) return -1;
        } else if (skip(&r, 1) < 0) {
            return bad("not msgpack (malformed or nested too deeply)");
        }
#undef KEY
    }
    if (r.p != r.end) return bad("not msgpack (extra bytes after the request map)");
    if (q->rid == NULL) return bad("no rid");
    return 0;
}

static PyObject *or_none(PyObject *o) { return o != NULL ? Py_NewRef(o) : Py_NewRef(Py_None); }

/* read_request(frame, block_size) -> (rid, n_ids, num_tokens, routed_dp_rank, bootstrap_room,
   hashes): n_ids -1 without input_ids; num_tokens None unless an int; hashes None unless
   block_size > 0 and input_ids are there. ValueError says what is malformed. */
static PyObject *read_request(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_request(frame, block_size)");
        return NULL;
    }
    Py_ssize_t block_size = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 0) return PyErr_Format(PyExc_ValueError, "block_size must be >= 0, got %zd", block_size);
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    Request q = {NULL, NULL, NULL, NULL, NULL, -1};
    PyObject *res = NULL;
    if (parse_request((const uint8_t *)buf.buf, buf.len, block_size, &q) == 0) {
        res = Py_BuildValue("(NnNNNN)", Py_NewRef(q.rid), q.n_ids, or_none(q.num_tokens), or_none(q.routed),
                            or_none(q.room), or_none(q.hashes));
    }
    request_clear(&q);
    PyBuffer_Release(&buf);
    return res;
}

/* hash_frame_blocks(frame, block_size) -> (num_tokens, bytes) | None: read_request's input_ids and
   hashes alone (the same parse); None when the frame has no input_ids (or they are nil). */
static PyObject *hash_frame_blocks(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hash_frame_blocks(frame, block_size)");
        return NULL;
    }
    Py_ssize_t block_size = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if ((block_size == -1 && PyErr_Occurred()) || check_block_size(block_size) < 0) return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) return NULL;
    Request q = {NULL, NULL, NULL, NULL, NULL, -1};
    PyObject *res = NULL;
    Cursor r = {(const uint8_t *)buf.buf, (const uint8_t *)buf.buf + buf.len};
    int ok = parse_request(r.p, buf.len, block_size, &q);
    if (ok < 0 && PyErr_ExceptionMatches(PyExc_ValueError) && q.rid == NULL) {
        /* hashing alone does not need a rid: only that error is forgiven */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int no_rid = value != NULL && PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, "no rid") == 0;
        if (no_rid) {
            Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
            ok = 0;
        } else {
            PyErr_Restore(type, value, tb);
        }
    }
    if (ok == 0) res = q.n_ids < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nO)", q.n_ids, q.hashes);
    request_clear(&q);
    PyBuffer_Release(&buf);
    return res;
}

static PyMethodDef prefix_methods[] = {
    {"hash_token_blocks", (PyCFunction)(void (*)(void))hash_token_blocks, METH_FASTCALL,
     "hash_token_blocks(ids, block_size) -> bytes of native uint64 chained block hashes"},
    {"read_request", (PyCFunction)(void (*)(void))read_request, METH_FASTCALL,
     "read_request(frame, block_size) -> (rid, n_ids, num_tokens, routed_dp_rank, bootstrap_room, hashes)"},
    {"hash_frame_blocks", (PyCFunction)(void (*)(void))hash_frame_blocks, METH_FASTCALL,
     "hash_frame_blocks(frame, block_size) -> (num_tokens, hashes) from a msgpack request frame, or None"},
    {NULL}};

static struct PyModuleDef prefix_module = {
    PyModuleDef_HEAD_INIT, "dpboard.controller._prefix", "Chained prompt block hashes (see the source).", -1,
    prefix_methods,
};

PyMODINIT_FUNC PyInit__prefix(void) { return PyModule_Create(&prefix_module); }
