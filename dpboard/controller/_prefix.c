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

/* -- msgpack: the frame checked as the schedulers' msgpack.unpackb reads it -------------------- */

/* The controller forwards a frame's bytes to a scheduler, which decodes them with msgpack-python's
   unpackb and its defaults (raw=False, strict_map_key=True, timestamp=0, the default ext_hook). A
   frame that decoder refuses must never be forwarded: the scheduler could not read it, and a
   request it never counts is sent to the next rank. So this reader refuses exactly what that
   decoder refuses, and no more (tests/controller/test_request_frames.py checks it against msgpack):
   - a container opened while MAX_NESTING are open (msgpack's stack), empty ones included;
   - a string that is not strict UTF-8 (as Python decodes it: no surrogates, no overlong forms,
     nothing above U+10FFFF), keys included;
   - a map key, at any depth, that is not a string or bytes;
   - an ext of a negative type code other than -1 (ExtType takes 0..127 only), a timestamp (-1)
     that is not 4, 8 or 12 bytes long, or one whose nanoseconds exceed 999999999;
   - the byte 0xc1, a value cut short, bytes after the top value.
   Any int, of any width or sign, is fine where the controller does not read it. */
#define MAX_NESTING 1024
#define MAX_NANOSECONDS 999999999ULL

typedef struct {
    const uint8_t *p, *end;
    const char *why; /* why the frame is not msgpack, set where the reading stopped */
} Cursor;

static inline int need(Cursor *r, Py_ssize_t n) { return r->end - r->p >= n ? 0 : -1; }

static inline int fail(Cursor *r, const char *why) {
    r->why = why;
    return -1;
}

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static inline int is_str(uint8_t t) { return (t >= 0xa0 && t <= 0xbf) || (t >= 0xd9 && t <= 0xdb); }
static inline int is_bin(uint8_t t) { return t >= 0xc4 && t <= 0xc6; }
static inline int is_int(uint8_t t) { return t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3); }

/* Strict UTF-8 (Unicode's well-formed sequences, which is what Python's "strict" decoding accepts). */
static int utf8_ok(const uint8_t *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        if (n - i >= 8) { /* ASCII, 8 bytes at a time */
            uint64_t w;
            memcpy(&w, s + i, 8);
            if ((w & 0x8080808080808080ULL) == 0) {
                i += 8;
                continue;
            }
        }
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        Py_ssize_t len = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        if (len == 0 || n - i < len) return 0;
        for (Py_ssize_t j = 1; j < len; j++)
            if ((s[i + j] & 0xc0) != 0x80) return 0;
        uint8_t c1 = s[i + 1];
        if ((c == 0xe0 && c1 < 0xa0) || (c == 0xed && c1 > 0x9f) || (c == 0xf0 && c1 < 0x90) || (c == 0xf4 && c1 > 0x8f))
            return 0; /* overlong, a surrogate, or above U+10FFFF */
        i += len;
    }
    return 1;
}

/* Reads an integer (any msgpack int encoding) into *v; -1 if the next value is not an int that
   fits int64 (a uint64 above INT64_MAX included), or is cut short (then r->why says so). */
static int read_int(Cursor *r, int64_t *v) {
    if (need(r, 1) < 0) return fail(r, "truncated");
    uint8_t t = *r->p;
    if (t <= 0x7f) { r->p++; *v = t; return 0; }
    if (t >= 0xe0) { r->p++; *v = (int8_t)t; return 0; }
    if (t >= 0xcc && t <= 0xd3) {
        int n = 1 << ((t - 0xcc) & 3); /* 0xcc..0xcf uint, 0xd0..0xd3 int: 1, 2, 4, 8 bytes */
        if (need(r, 1 + n) < 0) return fail(r, "truncated int");
        uint64_t u = be(r->p + 1, n);
        if (t <= 0xcf) {
            if (u > (uint64_t)INT64_MAX) return -1;
            *v = (int64_t)u;
        } else {
            int shift = 64 - 8 * n; /* sign-extend */
            *v = (int64_t)(u << shift) >> shift;
        }
        r->p += 1 + n;
        return 0;
    }
    return -1;
}

/* Reads a map or array header: its count into *n; -1 if the next value is neither of `kind` (or its
   header is cut short: then r->why says so). A count the rest of the frame cannot hold (an element
   takes a byte at least, an entry two) is a frame cut short. */
static int read_header(Cursor *r, int is_map, Py_ssize_t *n) {
    if (need(r, 1) < 0) return fail(r, "truncated");
    uint8_t t = *r->p;
    uint8_t fix_lo = is_map ? 0x80 : 0x90, b16 = is_map ? 0xde : 0xdc, b32 = is_map ? 0xdf : 0xdd;
    if (t >= fix_lo && t <= fix_lo + 0x0f) {
        r->p++;
        *n = t & 0x0f;
    } else if (t == b16 || t == b32) {
        int w = t == b16 ? 2 : 4;
        if (need(r, 1 + w) < 0) return fail(r, "truncated header");
        *n = (Py_ssize_t)be(r->p + 1, w);
        r->p += 1 + w;
    } else {
        return -1;
    }
    if (*n > (r->end - r->p) / (is_map ? 2 : 1)) return fail(r, is_map ? "truncated map" : "truncated array");
    return 0;
}

/* The string at the cursor, consumed: its bytes in *s, *len. -1 (nothing consumed) if the value is
   not a str; -2 if it is cut short or not strict UTF-8 (r->why says which). */
static int read_str(Cursor *r, const char **s, Py_ssize_t *len) {
    if (need(r, 1) < 0) return fail(r, "truncated") - 1;
    uint8_t t = *r->p;
    Py_ssize_t head;
    if (t >= 0xa0 && t <= 0xbf) { *len = t & 0x1f; head = 1; }
    else if (t == 0xd9 || t == 0xda || t == 0xdb) {
        int w = t == 0xd9 ? 1 : t == 0xda ? 2 : 4;
        if (need(r, 1 + w) < 0) return fail(r, "truncated string") - 1;
        *len = (Py_ssize_t)be(r->p + 1, w);
        head = 1 + w;
    } else {
        return -1;
    }
    if (need(r, head + *len) < 0) return fail(r, "truncated string") - 1;
    if (!utf8_ok(r->p + head, *len)) return fail(r, "a string that is not valid UTF-8") - 1;
    *s = (const char *)r->p + head;
    r->p += head + *len;
    return 0;
}

/* A bin or ext at the cursor (checked as msgpack-python decodes it), consumed; -1 if malformed. */
static int skip_bytes(Cursor *r, uint8_t t) {
    Py_ssize_t len, head;
    int ext = !is_bin(t);
    if (t >= 0xd4 && t <= 0xd8) { /* fixext 1..16 */
        len = (Py_ssize_t)1 << (t - 0xd4);
        head = 1;
    } else {
        int w = (t == 0xc4 || t == 0xc7) ? 1 : (t == 0xc5 || t == 0xc8) ? 2 : 4;
        if (need(r, 1 + w) < 0) return fail(r, ext ? "truncated ext" : "truncated bytes");
        len = (Py_ssize_t)be(r->p + 1, w);
        head = 1 + w;
    }
    if (ext) head++; /* the type code */
    if (need(r, head + len) < 0) return fail(r, ext ? "truncated ext" : "truncated bytes");
    if (ext) {
        int8_t code = (int8_t)r->p[head - 1];
        const uint8_t *data = r->p + head;
        if (code == -1) { /* a timestamp: 32 bits of seconds; 30 of nanoseconds and 34 of seconds; or 32 and 64 */
            if (len != 4 && len != 8 && len != 12)
                return fail(r, "a timestamp ext (type -1) that is not 4, 8 or 12 bytes long");
            if ((len == 8 && (be(data, 8) >> 34) > MAX_NANOSECONDS) || (len == 12 && be(data, 4) > MAX_NANOSECONDS))
                return fail(r, "a timestamp ext with nanoseconds above 999999999");
        } else if (code < 0) {
            return fail(r, "an ext type code outside 0..127 (other than -1, the timestamp)");
        }
    }
    r->p += head + len;
    return 0;
}

static int skip(Cursor *r, int depth);

/* A map key, consumed: strict_map_key admits a str or bytes only. */
static int skip_key(Cursor *r) {
    if (need(r, 1) < 0) return fail(r, "truncated map");
    uint8_t t = *r->p;
    if (is_str(t)) {
        const char *s;
        Py_ssize_t n;
        return read_str(r, &s, &n) == 0 ? 0 : -1;
    }
    if (is_bin(t)) return skip_bytes(r, t);
    return fail(r, "a map key that is not a string or bytes");
}

/* Skips one value of any kind, `depth` containers deep; -1 when msgpack-python would refuse it. */
static int skip(Cursor *r, int depth) {
    if (need(r, 1) < 0) return fail(r, "truncated");
    uint8_t t = *r->p;
    Py_ssize_t n;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) { r->p++; return 0; } /* fixint, nil, bools */
    if (t >= 0xcc && t <= 0xd3) { /* any int: no range to check where the value is not read */
        int w = 1 << ((t - 0xcc) & 3);
        if (need(r, 1 + w) < 0) return fail(r, "truncated int");
        r->p += 1 + w;
        return 0;
    }
    if (t == 0xca || t == 0xcb) { /* float32, float64 */
        int w = t == 0xca ? 4 : 8;
        if (need(r, 1 + w) < 0) return fail(r, "truncated float");
        r->p += 1 + w;
        return 0;
    }
    if (is_str(t)) {
        const char *s;
        return read_str(r, &s, &n) == 0 ? 0 : -1;
    }
    if (is_bin(t) || (t >= 0xd4 && t <= 0xd8) || (t >= 0xc7 && t <= 0xc9)) return skip_bytes(r, t);
    int is_map = (t >= 0x80 && t <= 0x8f) || t == 0xde || t == 0xdf;
    if (is_map || (t >= 0x90 && t <= 0x9f) || t == 0xdc || t == 0xdd) {
        if (depth >= MAX_NESTING) return fail(r, "nested too deeply: more than 1024 levels");
        if (read_header(r, is_map, &n) < 0) return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (is_map && skip_key(r) < 0) return -1;
            if (skip(r, depth + 1) < 0) return -1;
        }
        return 0;
    }
    return fail(r, "the byte 0xc1, which msgpack never uses");
}

/* The Python type msgpack decodes a value of first byte t into, for messages. */
static const char *kind_name(uint8_t t) {
    if (is_int(t)) return "int";
    if (t >= 0x80 && t <= 0x8f) return "dict";
    if (t >= 0x90 && t <= 0x9f) return "list";
    if (is_str(t)) return "str";
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

/* Any msgpack int at the cursor as a Python int (uint64 included), consumed; NULL if not an int
   (nothing consumed, no Python error set) or on a Python error. */
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

/* The keys the controller reads. */
enum { K_RID, K_IDS, K_NUM, K_ROUTED, K_ROOM, N_KEYS };
#define ERROR_LEN 112

/* What the controller reads of a request frame. New references, NULL while absent. A key whose
   (last) value is not what a request needs has its reason in error[key]; it counts only once the
   whole frame has been read as msgpack, since a later entry of the same key replaces it. */
typedef struct {
    PyObject *rid, *num_tokens, *routed, *room, *hashes;
    Py_ssize_t n_ids; /* -1: no input_ids (absent or nil) */
    char error[N_KEYS][ERROR_LEN];
} Request;

static void request_init(Request *q) {
    q->rid = q->num_tokens = q->routed = q->room = q->hashes = NULL;
    q->n_ids = -1;
    for (int k = 0; k < N_KEYS; k++) q->error[k][0] = '\0';
}

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

/* Each reader of a key's value returns 0 (read), 1 (well-formed msgpack, perhaps, but not what a
   request needs: q->error[key] says why, and the caller skips the value from its start), or -1 (not
   msgpack, r->why says why; or a Python error is set). */

/* rid: a str or an int. */
static int read_rid(Cursor *r, Request *q) {
    const char *s;
    Py_ssize_t n;
    uint8_t t = *r->p;
    Py_CLEAR(q->rid);
    q->error[K_RID][0] = '\0';
    int got = read_str(r, &s, &n);
    if (got == 0) {
        q->rid = PyUnicode_DecodeUTF8(s, n, "strict");
        return q->rid == NULL ? -1 : 0;
    }
    if (got == -2) return -1;
    if ((q->rid = read_pyint(r)) != NULL) return 0;
    if (PyErr_Occurred()) return -1;
    snprintf(q->error[K_RID], ERROR_LEN, "rid must be a string or int, got %s", kind_name(t));
    return 1;
}

/* input_ids: nil, or an array of ints (each within int64); hashed when block_size > 0. */
static int read_ids(Cursor *r, Request *q, Py_ssize_t block_size) {
    Py_CLEAR(q->hashes);
    q->n_ids = -1;
    q->error[K_IDS][0] = '\0';
    if (*r->p == 0xc0) { r->p++; return 0; }
    Py_ssize_t n;
    uint8_t t = *r->p;
    if (read_header(r, 0, &n) < 0) {
        if (r->why != NULL) {
            if (strcmp(r->why, "truncated array") == 0) r->why = "input_ids claims more elements than the frame holds";
            return -1;
        }
        snprintf(q->error[K_IDS], ERROR_LEN, "input_ids must be a list, got %s", kind_name(t));
        return 1;
    }
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
            if (r->why != NULL) return -1;
            snprintf(q->error[K_IDS], ERROR_LEN, "input_ids[%zd] is not an integer that fits 64 bits", i);
            return 1;
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

/* num_tokens: read when an int; anything else leaves it None (the caller says what a request needs). */
static int read_num_tokens(Cursor *r, Request *q) {
    Py_CLEAR(q->num_tokens);
    q->num_tokens = read_pyint(r);
    if (q->num_tokens != NULL) return 0;
    if (PyErr_Occurred()) return -1;
    return skip(r, 1);
}

/* An optional int (routed_dp_rank, bootstrap_room): nil or an int. */
static int read_optional_int(Cursor *r, PyObject **slot, char *error, const char *key) {
    Py_CLEAR(*slot);
    error[0] = '\0';
    if (*r->p == 0xc0) {
        r->p++;
        *slot = Py_NewRef(Py_None);
        return 0;
    }
    uint8_t t = *r->p;
    if ((*slot = read_pyint(r)) != NULL) return 0;
    if (PyErr_Occurred()) return -1;
    snprintf(error, ERROR_LEN, "%s must be an int or nil, got %s", key, kind_name(t));
    return 1;
}

/* The one parse of a request frame: a msgpack map whose keys rid, input_ids, num_tokens,
   routed_dp_rank and bootstrap_room are read (the last of a repeated key counts, as msgpack's own
   decoder does: an earlier value that a request could not use does not matter), every other entry
   checked and skipped without building anything. The frame is refused when msgpack-python would
   refuse it (see above), when it is not a map, when the last rid is missing or not a str or int,
   when input_ids is neither nil nor a list of ints within int64, or when routed_dp_rank or
   bootstrap_room is neither nil nor an int. No object per token. */
static int parse_request(const uint8_t *p, Py_ssize_t len, Py_ssize_t block_size, Request *q) {
    Cursor r = {p, p + len, NULL};
    Py_ssize_t n_keys;
    if (need(&r, 1) < 0) return bad("not msgpack (empty frame)");
    uint8_t t0 = *r.p;
    if (read_header(&r, 1, &n_keys) < 0) {
        if (r.why != NULL) goto not_msgpack;
        PyErr_Format(PyExc_ValueError, "not a map but %s", kind_name(t0));
        return -1;
    }
    for (Py_ssize_t k = 0; k < n_keys; k++) {
        const char *key;
        Py_ssize_t key_len;
        if (need(&r, 1) < 0) {
            r.why = "truncated map";
            goto not_msgpack;
        }
        int got = read_str(&r, &key, &key_len);
        if (got == -2) goto not_msgpack;
        if (got == -1) { /* bytes (not one of ours), or a key strict_map_key refuses */
            if (skip_key(&r) < 0 || skip(&r, 1) < 0) goto not_msgpack;
            continue;
        }
        if (need(&r, 1) < 0) {
            r.why = "truncated map";
            goto not_msgpack;
        }
        const uint8_t *at = r.p;
        int res;
#define KEY(lit) (key_len == (Py_ssize_t)sizeof(lit) - 1 && memcmp(key, lit, sizeof(lit) - 1) == 0)
        if (KEY("rid")) res = read_rid(&r, q);
        else if (KEY("input_ids")) res = read_ids(&r, q, block_size);
        else if (KEY("num_tokens")) res = read_num_tokens(&r, q);
        else if (KEY("routed_dp_rank")) res = read_optional_int(&r, &q->routed, q->error[K_ROUTED], "routed_dp_rank");
        else if (KEY("bootstrap_room")) res = read_optional_int(&r, &q->room, q->error[K_ROOM], "bootstrap_room");
        else res = skip(&r, 1);
#undef KEY
        if (res > 0) { /* not usable, but it must still be msgpack */
            r.p = at;
            res = skip(&r, 1);
        }
        if (res < 0) {
            if (PyErr_Occurred()) return -1;
            goto not_msgpack;
        }
    }
    if (r.p != r.end) return bad("not msgpack (extra bytes after the request map)");
    for (int k = 0; k < N_KEYS; k++)
        if (q->error[k][0] != '\0') return bad(q->error[k]);
    if (q->rid == NULL) return bad("no rid");
    return 0;
not_msgpack:
    PyErr_Format(PyExc_ValueError, "not msgpack (%s)", r.why != NULL ? r.why : "malformed");
    return -1;
}

static PyObject *or_none(PyObject *o) { return o != NULL ? Py_NewRef(o) : Py_NewRef(Py_None); }

/* read_request(frame, block_size) -> (rid, n_ids, num_tokens, routed_dp_rank, bootstrap_room,
   hashes): n_ids -1 without input_ids; num_tokens None unless an int; hashes None unless
   block_size > 0 and input_ids are there. ValueError(message) says what is malformed, or
   ValueError(message, rid) when a usable rid had been read by then. */
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
    Request q;
    request_init(&q);
    PyObject *res = NULL;
    if (parse_request((const uint8_t *)buf.buf, buf.len, block_size, &q) == 0) {
        res = Py_BuildValue("(NnNNNN)", Py_NewRef(q.rid), q.n_ids, or_none(q.num_tokens), or_none(q.routed),
                            or_none(q.room), or_none(q.hashes));
    } else if (q.rid != NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
        /* the rid read before the fault goes with the error: the sender can be answered */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *message = value != NULL ? PyObject_Str(value) : NULL;
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (message != NULL) {
            PyObject *exc_args = Py_BuildValue("(NO)", message, q.rid);
            if (exc_args != NULL) {
                PyErr_SetObject(PyExc_ValueError, exc_args);
                Py_DECREF(exc_args);
            }
        }
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
    Request q;
    request_init(&q);
    PyObject *res = NULL;
    int ok = parse_request((const uint8_t *)buf.buf, buf.len, block_size, &q);
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
