/*
 * dpboard.controller._dispatch: the per-request part of load-aware dispatch, over the budget's NumPy arrays.
 *
 * Why C: one decision is "read two attributes of the request, argmin over the candidate ranks,
 * add the speculative +1 / +tokens". In Python each of those is a few hundred nanoseconds of
 * interpreter work; a batch of 1024 requests must cost <= 0.2 us per request with the request
 * objects read. The arrays stay owned by dpboard.controller.budget.DPBudget (NumPy, refreshed
 * vectorised from the board); this type only holds pointers into them and changes them in place.
 * dpboard/controller/budget.py has PyArgminCore, the same rules in Python: the tests check that
 * both pick the same ranks.
 *
 * Rules (docs/DISPATCH.md, "The rules" and "What dpboard adds"):
 *   - routed_dp_rank set: that rank, if it is an int in range and routable (active), else
 *     ValueError("DP rank {rank} is not active."). It is charged like any pick.
 *   - otherwise argmin over candidate ranks of the core's key (enum key below; each method's key is
 *     its row in dpboard/methods.py, ArgminKey, whose values these are: the module exports
 *     them as KEY_<NAME> and budget.py compares them at import): KEY_REQUESTS requests alone;
 *     KEY_TOKENS (tokens, requests); KEY_BACKLOG (backlog, tokens): queued prefill tokens first, or
 *     with pick_saving (inflight_cache) (backlog + the tokens the rank's prefix cache does not hold,
 *     tokens); KEY_HEADROOM (inflight_ttft) the same among the ranks whose KV can hold the uncached
 *     prompt (tokens[r] + uncached <= capacity[r], or no capacity published), before any rank that
 *     cannot, and among those the fewest tokens[r] + uncached; KEY_LOCKSTEP (inflight_lockstep) among
 *     the ranks with room whose first token comes within max(earliest, horizon) group steps
 *     (s[r] = ceil((backlog[r] + uncached) / chunk[r])), the fewest running[r] * (s[r] -
 *     ceil(backlog[r] / chunk[r])) (the decodes its prefill stalls), then the earlier s[r], then
 *     fewer tokens; no rank with room: as KEY_HEADROOM; ties
 *     go to the first rank met scanning from 0 (seed) or from the rank after the last pick (rotate).
 *   - a pick adds 1 request and the request's tokens (len(input_ids), else num_tokens) to the budget
 *     (to tokens, and to backlog when the budget keeps one: the prompt queues for prefill),
 *     and records the send in the ledger: sent_reqs[r] += 1, sent_tokens[r] += tokens, and
 *     ring[r, sent_reqs[r] % cap] = sent_tokens[r] (cumulative tokens after the k-th send), from which
 *     the refresh computes the tokens still in flight.
 *   - a batch is all or nothing: when one request fails, the picks before it are undone.
 *   - retract(rank, tokens) undoes the latest charge to a rank (its send failed): the budget and the
 *     ledger lose that request again. The ring slot it wrote is left as it is; the next charge
 *     overwrites it (see DPBudget.retract for the one case where that matters).
 *   - no sum wraps: a request has at most MAX_REQUEST_TOKENS tokens (a larger one is an error), and
 *     every addition saturates at INT64_MAX, so a rank published at 2**63-1 plus a charge stays the
 *     most loaded, never negative (and so never the argmin by accident).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The largest request, in tokens (dpboard.controller.budget.MAX_REQUEST_TOKENS, compared at import). */
#define MAX_REQUEST_TOKENS (INT64_C(1) << 32)

/* The argmin keys: the values of dpboard.methods.ArgminKey (exported as KEY_<NAME>, compared
   at import), and the arrays each reads beyond the tokens and requests every core has. */
enum { KEY_REQUESTS, KEY_TOKENS, KEY_BACKLOG, KEY_HEADROOM, KEY_LOCKSTEP, NUM_KEYS };
enum { NEEDS_BACKLOG = 1, NEEDS_CAPACITY = 2, NEEDS_RUNNING_CHUNK = 4 };
static const struct {
    const char *name;
    int needs;
    const char *missing; /* the error when the core lacks what the key reads */
} KEYS[NUM_KEYS] = {
    [KEY_REQUESTS] = {"KEY_REQUESTS", 0, NULL},
    [KEY_TOKENS] = {"KEY_TOKENS", 0, NULL},
    [KEY_BACKLOG] = {"KEY_BACKLOG", NEEDS_BACKLOG, "key BACKLOG needs the backlog array (queued prefill tokens per rank)"},
    [KEY_HEADROOM] = {"KEY_HEADROOM", NEEDS_BACKLOG | NEEDS_CAPACITY,
                      "key HEADROOM needs the backlog and capacity arrays (queued prefill and KV capacity per rank)"},
    [KEY_LOCKSTEP] = {"KEY_LOCKSTEP", NEEDS_BACKLOG | NEEDS_CAPACITY | NEEDS_RUNNING_CHUNK,
                      "key LOCKSTEP needs the backlog, capacity, running and chunk arrays (queued prefill, KV "
                      "capacity, running requests and prefill chunk per rank)"},
};

static PyObject *s_routed_dp_rank, *s_input_ids, *s_num_tokens;
/* dpboard.errors.InvalidInputError (a ValueError) and UnavailableError (a RuntimeError): what a bad
   request and a request no rank can take raise, as in the Python twin. */
static PyObject *InvalidInputError, *UnavailableError;

typedef struct {
    PyObject_HEAD
    Py_buffer bufs[11]; /* tokens, requests, candidate, routable, sent_reqs, sent_tokens, ring, backlog, capacity,
                           running, chunk */
    int nbufs;
    int64_t *tokens, *requests, *sent_reqs, *sent_tokens, *ring, *backlog, *capacity;
    const int64_t *running, *chunk;
    const uint8_t *candidate, *routable;
    Py_ssize_t n, ring_cap;
    int key, rotate;
    int64_t horizon;
    Py_ssize_t next_start;
    /* the refresh throttle: due when clock() - last_refresh >= interval (clock NULL: never due) */
    PyObject *clock;
    double interval, last_refresh;
} Core;

/* True when a buffer's struct format is a native-order int64 (itemsize 8) or a bool/byte (itemsize 1):
   the item size alone would take float64 values as int64. */
static int format_ok(const char *format, Py_ssize_t itemsize) {
    if (format == NULL) format = "B";
    if (*format == '@' || *format == '=' || *format == '<') format++;
    if (format[0] == '\0' || format[1] != '\0') return 0;
    if (itemsize == 8) return format[0] == 'q' || format[0] == 'l';
    return format[0] == '?' || format[0] == 'B' || format[0] == 'b';
}

static int get_array(Core *self, PyObject *obj, const char *what, Py_ssize_t itemsize, Py_ssize_t min_len,
                     void **out, Py_ssize_t *len_out) {
    Py_buffer *b = &self->bufs[self->nbufs];
    if (PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable C-contiguous array", what);
        return -1;
    }
    self->nbufs++;
    if (b->itemsize != itemsize || !format_ok(b->format, itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s must be an array of %s, got format %s with %zd-byte items", what,
                     itemsize == 8 ? "int64" : "bool", b->format ? b->format : "B", b->itemsize);
        return -1;
    }
    Py_ssize_t len = b->len / itemsize;
    if (len < min_len) {
        PyErr_Format(PyExc_ValueError, "%s has %zd items, needs at least %zd", what, len, min_len);
        return -1;
    }
    *out = b->buf;
    if (len_out) *len_out = len;
    return 0;
}

static int core_init_arrays(Core *self, PyObject *args, PyObject *kwds);

/* A failed __init__ releases what it took: the core is then empty (n == 0, nothing to pick from),
   never a half-made one with pointers still unset. */
static int core_init(Core *self, PyObject *args, PyObject *kwds) {
    if (core_init_arrays(self, args, kwds) == 0) return 0;
    if (self->nbufs && !(PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_RuntimeError))) {
        for (int i = 0; i < self->nbufs; i++) PyBuffer_Release(&self->bufs[i]);
        self->nbufs = 0;
        self->n = 0;
        self->tokens = self->requests = self->sent_reqs = self->sent_tokens = self->ring = self->backlog = NULL;
        self->capacity = NULL;
        self->running = self->chunk = NULL;
        self->candidate = self->routable = NULL;
        self->key = KEY_REQUESTS;
        self->ring_cap = 0;
    }
    return -1;
}

/* 0 when the core holds what `key` reads, else -1 with the key's error (an unknown key included). */
static int check_key(Core *self, long key) {
    if (key < 0 || key >= NUM_KEYS) {
        PyErr_Format(PyExc_ValueError, "key must be one of the KEY_* constants (0..%d), got %ld", NUM_KEYS - 1, key);
        return -1;
    }
    int needs = KEYS[key].needs;
    if (((needs & NEEDS_BACKLOG) && !self->backlog) || ((needs & NEEDS_CAPACITY) && !self->capacity) ||
        ((needs & NEEDS_RUNNING_CHUNK) && !(self->running && self->chunk))) {
        PyErr_SetString(PyExc_ValueError, KEYS[key].missing);
        return -1;
    }
    return 0;
}

/* The array named `name` of `arrays` (a DPBudget, or any object with those attributes): required, or
   optional (absent or None: *out stays NULL). */
static int array_attr(Core *self, PyObject *arrays, const char *name, int required, Py_ssize_t itemsize,
                      Py_ssize_t min_len, void **out, Py_ssize_t *len_out) {
    PyObject *obj = PyObject_GetAttrString(arrays, name);
    if (obj == NULL) {
        if (required || !PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    int rc = 0;
    if (obj != Py_None || required) rc = get_array(self, obj, name, itemsize, min_len, out, len_out);
    Py_DECREF(obj);
    return rc;
}

static int core_init_arrays(Core *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"arrays", "key", "rotate", "horizon", "clock", "interval", NULL};
    PyObject *arrays, *clock = Py_None;
    int key = KEY_TOKENS, rotate = 0;
    long long horizon = 0;
    double interval = 0.0;
    if (self->nbufs) {
        PyErr_SetString(PyExc_RuntimeError, "ArgminCore is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|ipLOd", kwlist, &arrays, &key, &rotate, &horizon, &clock,
                                     &interval))
        return -1;
    if (clock != Py_None && !PyCallable_Check(clock)) {
        PyErr_SetString(PyExc_ValueError, "clock must be a callable returning seconds, or None");
        return -1;
    }
    if (horizon < 0) {
        PyErr_SetString(PyExc_ValueError, "horizon must be >= 0 group steps");
        return -1;
    }
    Py_ssize_t n, ring_len;
    if (array_attr(self, arrays, "total_tokens", 1, 8, 1, (void **)&self->tokens, &n) < 0) return -1;
    self->n = n;
    if (array_attr(self, arrays, "total_requests", 1, 8, n, (void **)&self->requests, NULL) < 0 ||
        array_attr(self, arrays, "candidate", 1, 1, n, (void **)&self->candidate, NULL) < 0 ||
        array_attr(self, arrays, "routable", 1, 1, n, (void **)&self->routable, NULL) < 0 ||
        array_attr(self, arrays, "sent_reqs", 1, 8, n, (void **)&self->sent_reqs, NULL) < 0 ||
        array_attr(self, arrays, "sent_tokens", 1, 8, n, (void **)&self->sent_tokens, NULL) < 0 ||
        array_attr(self, arrays, "ring", 0, 8, n, (void **)&self->ring, &ring_len) < 0 ||
        array_attr(self, arrays, "backlog", 0, 8, n, (void **)&self->backlog, NULL) < 0 ||
        array_attr(self, arrays, "capacity", 0, 8, n, (void **)&self->capacity, NULL) < 0 ||
        array_attr(self, arrays, "running", 0, 8, n, (void **)&self->running, NULL) < 0 ||
        array_attr(self, arrays, "chunk", 0, 8, n, (void **)&self->chunk, NULL) < 0)
        return -1;
    if (self->ring) self->ring_cap = ring_len / n;
    if (check_key(self, key) < 0) return -1;
    self->key = key;
    self->horizon = (int64_t)horizon;
    self->rotate = rotate;
    Py_XSETREF(self->clock, clock == Py_None ? NULL : Py_NewRef(clock));
    self->interval = interval;
    self->last_refresh = -INFINITY; /* the first pick refreshes */
    return 0;
}

/* The clock may be a bound method of an object that holds this core (the simulator's): the core
   takes part in garbage collection so that such a cycle is freed. */
static int core_traverse(Core *self, visitproc visit, void *arg) {
    Py_VISIT(self->clock);
    return 0;
}

static int core_clear(Core *self) {
    Py_CLEAR(self->clock);
    return 0;
}

static void core_dealloc(Core *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    for (int i = 0; i < self->nbufs; i++) PyBuffer_Release(&self->bufs[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1 when a refresh is due (last_refresh is then now), 0 when not, -1 with an exception (the clock's). */
static int refresh_due(Core *self) {
    if (self->clock == NULL) return 0;
    PyObject *t = PyObject_CallNoArgs(self->clock);
    if (t == NULL) return -1;
    double now = PyFloat_AsDouble(t);
    Py_DECREF(t);
    if (now == -1.0 && PyErr_Occurred()) return -1;
    if (!(now - self->last_refresh >= self->interval)) return 0;
    self->last_refresh = now;
    return 1;
}

/* obj's attribute `name`: 1 with a new reference in *out, 0 when it is absent or None, -1 with an
   exception (any but AttributeError). */
static inline int optional_attr(PyObject *obj, PyObject *name, PyObject **out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    if (v == Py_None) {
        Py_DECREF(v);
        return 0;
    }
    *out = v;
    return 1;
}

/* 1 when obj is an int (a bool is not): *value is it and *fits 1, or *fits 0 when it does not fit a
   long long. 0 when obj is no int. Never an exception. */
static inline int int_value(PyObject *obj, long long *value, int *fits) {
    if (!PyLong_Check(obj) || PyBool_Check(obj)) return 0;
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    *fits = !overflow;
    return 1;
}

/* The request's token estimate: len(input_ids), else num_tokens. -1 with an exception on bad input. */
static int64_t request_tokens(PyObject *req) {
    PyObject *ids, *nt;
    int has = optional_attr(req, s_input_ids, &ids);
    if (has < 0) return -1;
    if (has) {
        Py_ssize_t len = PyList_CheckExact(ids) ? PyList_GET_SIZE(ids) : PyObject_Length(ids);
        if (len < 0) {
            PyErr_Clear();
            PyErr_Format(InvalidInputError, "request input_ids must be a sequence of token ids, got %R",
                         Py_TYPE(ids));
            Py_DECREF(ids);
            return -1;
        }
        Py_DECREF(ids);
        if ((int64_t)len > MAX_REQUEST_TOKENS) {
            PyErr_Format(InvalidInputError, "request of %zd tokens is larger than the %lld tokens a request may have",
                         len, (long long)MAX_REQUEST_TOKENS);
            return -1;
        }
        return (int64_t)len;
    }
    has = optional_attr(req, s_num_tokens, &nt);
    if (has < 0) return -1;
    if (!has) {
        PyErr_SetString(InvalidInputError,
                        "request has neither input_ids nor num_tokens: give it one of them (the token estimate)");
        return -1;
    }
    long long v;
    int fits;
    if (!int_value(nt, &v, &fits)) {
        PyErr_Format(InvalidInputError, "request num_tokens must be an int >= 0, got %R", nt);
        Py_DECREF(nt);
        return -1;
    }
    if (!fits || v < 0 || v > MAX_REQUEST_TOKENS) {
        PyErr_Format(InvalidInputError, "request num_tokens must be an int in [0, %lld], got %R",
                     (long long)MAX_REQUEST_TOKENS, nt);
        Py_DECREF(nt);
        return -1;
    }
    Py_DECREF(nt);
    return (int64_t)v;
}

/* 1: routed to *rank; 0: not routed; -1: exception (invalid rank). */
static int request_routed(Core *self, PyObject *req, Py_ssize_t *rank) {
    PyObject *r;
    int has = optional_attr(req, s_routed_dp_rank, &r);
    if (has <= 0) return has;
    long long v;
    int fits;
    if (!int_value(r, &v, &fits)) {
        PyErr_Format(InvalidInputError, "routed_dp_rank must be an int or None, got %R", r);
        Py_DECREF(r);
        return -1;
    }
    if (!fits || v < 0 || v >= self->n || !self->routable[v]) {
        PyErr_Format(InvalidInputError, "DP rank %R is not active.", r);
        Py_DECREF(r);
        return -1;
    }
    Py_DECREF(r);
    *rank = (Py_ssize_t)v;
    return 1;
}

/* The end of every scan: no candidate is an error; with rotating ties, the next scan starts after
   this pick. Returns best, or -1 with the exception set. */
static inline Py_ssize_t settle_pick(Core *self, Py_ssize_t best) {
    if (best < 0) {
        PyErr_SetString(UnavailableError,
                        "no DP rank can take the request: every active rank is unavailable or unhealthy "
                        "(see set_active/set_status, and `dpboard dump` for stale slots)");
        return -1;
    }
    if (self->rotate) self->next_start = (best + 1 == self->n) ? 0 : best + 1;
    return best;
}

/* The plain keys: the lexicographic argmin of (first[r], then[r]) over the candidate ranks, ties to
   the scan order: KEY_TOKENS (tokens, requests), KEY_BACKLOG (backlog, tokens), KEY_REQUESTS
   (requests, requests: requests alone). */
static Py_ssize_t argmin(Core *self) {
    const Py_ssize_t n = self->n;
    const int64_t *first = self->requests, *then = self->requests;
    if (self->key == KEY_TOKENS) {
        first = self->tokens;
    } else if (self->key == KEY_BACKLOG) {
        first = self->backlog;
        then = self->tokens;
    }
    const uint8_t *cand = self->candidate;
    Py_ssize_t i = self->rotate ? self->next_start : 0, best = -1;
    int64_t bf = 0, bt = 0;
    if (i < 0 || i >= n) i = 0;
    for (Py_ssize_t k = 0; k < n; k++, i = (i + 1 == n) ? 0 : i + 1) {
        if (!cand[i]) continue;
        int64_t f = first[i], t = then[i];
        if (best < 0 || f < bf || (f == bf && t < bt)) {
            best = i;
            bf = f;
            bt = t;
        }
    }
    return settle_pick(self, best);
}

/* a + b for a, b >= 0, at most INT64_MAX: a load at the top stays at the top instead of wrapping. */
static inline int64_t sat_add(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

static Py_ssize_t argmin_saving(Core *self, int64_t t, const int64_t *sav, int64_t *uncached_out);

/* argmin_saving with no saving anywhere (the whole prompt, t tokens, is uncached on every rank):
   the same keys and picks, without the savings buffer. */
static Py_ssize_t argmin_headroom(Core *self, int64_t t) {
    const Py_ssize_t n = self->n;
    const int64_t *tok = self->tokens, *bl = self->backlog, *cap = self->capacity;
    const uint8_t *cand = self->candidate;
    Py_ssize_t i = self->rotate ? self->next_start : 0, best = -1;
    int64_t bk = 0, bt = 0;
    int bf = 0;
    if (i < 0 || i >= n) i = 0;
    for (Py_ssize_t k = 0; k < n; k++, i = (i + 1 == n) ? 0 : i + 1) {
        if (!cand[i]) continue;
        int64_t tt = tok[i], need = sat_add(tt, t);
        int full = cap[i] > 0 && need > cap[i];
        int64_t key = full ? need : sat_add(bl[i], t);
        if (best < 0 || full < bf || (full == bf && (key < bk || (key == bk && tt < bt)))) {
            best = i;
            bf = full;
            bk = key;
            bt = tt;
        }
    }
    return settle_pick(self, best);
}

/* ceil(a / c) for a >= 0, c >= 1. */
static inline int64_t ceil_div(int64_t a, int64_t c) { return a / c + (a % c != 0); }

/* The inflight_lockstep pick (see the header comment), t prompt tokens of which sav[r] are cached on
   rank r (sav NULL: none). Two scans in the same order: the earliest first-token step among the
   ranks whose KV has room (and, should no rank have room, inflight_ttft's pick among the full ones),
   then the fewest stalled decodes among the ranks within max(earliest, horizon) steps. */
static Py_ssize_t argmin_lockstep(Core *self, int64_t t, const int64_t *sav, int64_t *uncached_out) {
    const Py_ssize_t n = self->n;
    const int64_t *tok = self->tokens, *bl = self->backlog, *cap = self->capacity;
    const int64_t *run = self->running, *chk = self->chunk;
    const uint8_t *cand = self->candidate;
    Py_ssize_t start = self->rotate ? self->next_start : 0;
    if (start < 0 || start >= n) start = 0;
    int64_t earliest = INT64_MAX, fk = 0, ft = 0, fu = 0;
    Py_ssize_t full_best = -1, i = start;
    for (Py_ssize_t k = 0; k < n; k++, i = (i + 1 == n) ? 0 : i + 1) {
        if (!cand[i]) continue;
        int64_t u = sav ? (t > sav[i] ? t - sav[i] : 0) : t, need = sat_add(tok[i], u);
        if (cap[i] > 0 && need > cap[i]) {
            if (full_best < 0 || need < fk || (need == fk && tok[i] < ft)) {
                full_best = i;
                fk = need;
                ft = tok[i];
                fu = u;
            }
            continue;
        }
        int64_t s = ceil_div(sat_add(bl[i] > 0 ? bl[i] : 0, u), chk[i] > 0 ? chk[i] : 1);
        if (s < earliest) earliest = s;
    }
    if (earliest == INT64_MAX) {
        if (full_best >= 0) *uncached_out = fu;
        return settle_pick(self, full_best);
    }
    const int64_t limit = earliest > self->horizon ? earliest : self->horizon;
    Py_ssize_t best = -1;
    int64_t bk = 0, bs = 0, bt = 0, bu = 0;
    i = start;
    for (Py_ssize_t k = 0; k < n; k++, i = (i + 1 == n) ? 0 : i + 1) {
        if (!cand[i]) continue;
        int64_t u = sav ? (t > sav[i] ? t - sav[i] : 0) : t;
        if (cap[i] > 0 && sat_add(tok[i], u) > cap[i]) continue;
        int64_t c = chk[i] > 0 ? chk[i] : 1, b = bl[i] > 0 ? bl[i] : 0;
        int64_t s = ceil_div(sat_add(b, u), c);
        if (s > limit) continue;
        int64_t key, added = s - ceil_div(b, c);
        if (__builtin_mul_overflow(run[i] > 0 ? run[i] : 0, added, &key)) key = INT64_MAX;
        if (best < 0 || key < bk || (key == bk && (s < bs || (s == bs && tok[i] < bt)))) {
            best = i;
            bk = key;
            bs = s;
            bt = tok[i];
            bu = u;
        }
    }
    if (best >= 0) *uncached_out = bu;
    return settle_pick(self, best);
}

/* The rank for a request of t tokens with no saving anywhere, by the core's key. */
static Py_ssize_t argmin_key(Core *self, int64_t t) {
    int64_t unused;
    switch (self->key) {
    case KEY_LOCKSTEP:
        return argmin_lockstep(self, t, NULL, &unused);
    case KEY_HEADROOM:
        return argmin_headroom(self, t);
    default:
        return argmin(self);
    }
}

static inline void charge(Core *self, Py_ssize_t r, int64_t t) {
    self->tokens[r] = sat_add(self->tokens[r], t);
    self->requests[r] = sat_add(self->requests[r], 1);
    if (self->backlog) self->backlog[r] = sat_add(self->backlog[r], t);
    int64_t k = self->sent_reqs[r] = sat_add(self->sent_reqs[r], 1);
    int64_t cum = self->sent_tokens[r] = sat_add(self->sent_tokens[r], t);
    if (self->ring) self->ring[r * self->ring_cap + (Py_ssize_t)(k % self->ring_cap)] = cum;
}

static inline void uncharge(Core *self, Py_ssize_t r, int64_t t) {
    self->tokens[r] -= t;
    self->requests[r] -= 1;
    if (self->backlog) self->backlog[r] -= t;
    self->sent_reqs[r] -= 1;
    self->sent_tokens[r] -= t;
}

/* One request: its rank, charged; -1 with an exception. */
static Py_ssize_t pick_one(Core *self, PyObject *req, int64_t *tokens_out) {
    Py_ssize_t rank;
    int routed = request_routed(self, req, &rank);
    if (routed < 0) return -1;
    int64_t t = request_tokens(req);
    if (t < 0) return -1;
    if (!routed) {
        rank = argmin_key(self, t);
        if (rank < 0) return -1;
    }
    charge(self, rank, t);
    *tokens_out = t;
    return rank;
}

static PyObject *core_pick(Core *self, PyObject *req) {
    int64_t t;
    Py_ssize_t rank = pick_one(self, req, &t);
    if (rank < 0) return NULL;
    return PyLong_FromSsize_t(rank);
}

/* pick_fresh(req): None when the throttle says the budget must be refreshed first (the caller
   refreshes, then picks), else pick(req). The plain argmin's whole decision in one call. */
static PyObject *core_pick_fresh(Core *self, PyObject *req) {
    int due = refresh_due(self);
    if (due < 0) return NULL;
    if (due) Py_RETURN_NONE;
    return core_pick(self, req);
}

static PyObject *core_refresh_due(Core *self, PyObject *unused) {
    int due = refresh_due(self);
    if (due < 0) return NULL;
    return PyBool_FromLong(due);
}

static PyObject *core_pick_batch(Core *self, PyObject *reqs) {
    /* A tuple of the requests, not the list itself: reading a request (a property, an __index__)
       runs Python code that may change the list under this loop. */
    PyObject *seq = PySequence_Tuple(reqs);
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "pick_batch() needs a sequence of requests");
        }
        return NULL;
    }
    Py_ssize_t m = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    PyObject *out = PyList_New(m);
    int64_t *charged = PyMem_Malloc(sizeof(int64_t) * (m ? m : 1));
    if (out == NULL || charged == NULL) {
        Py_XDECREF(out);
        PyMem_Free(charged);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t saved_start = self->next_start;
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t rank = pick_one(self, items[j], &charged[j]);
        PyObject *rank_obj = rank < 0 ? NULL : PyLong_FromSsize_t(rank);
        if (rank_obj == NULL) {
            /* all or nothing: undo the picks made so far (this one too, when it was charged), in reverse */
            if (rank >= 0) uncharge(self, rank, charged[j]);
            for (Py_ssize_t u = j - 1; u >= 0; u--)
                uncharge(self, PyLong_AsSsize_t(PyList_GET_ITEM(out, u)), charged[u]);
            self->next_start = saved_start;
            PyMem_Free(charged);
            Py_DECREF(seq);
            Py_DECREF(out); /* slots from j on are NULL; list dealloc skips them */
            return NULL;
        }
        PyList_SET_ITEM(out, j, rank_obj);
    }
    PyMem_Free(charged);
    Py_DECREF(seq);
    return out;
}

/* The inflight_cache argmin: the rank where the request's first token comes soonest, counting the
   prefill work queued there and the part of the prompt (t tokens) that the rank's prefix cache does
   not hold (sav[r] tokens, from the controller's prefix index; none when sav is NULL): key
   backlog[r] + max(0, t - sav[r]), ties to fewer KV tokens, then to the scan order. With
   KEY_HEADROOM (inflight_ttft) a rank whose KV cannot hold the uncached prompt on top of what it
   holds and queues (tokens[r] + u > capacity[r]) comes after every rank that can, and among such
   ranks the key is tokens[r] + u: its prompt waits for running requests to free KV, and the rank
   with the fewest tokens frees room first. Needs the backlog array (and capacity for KEY_HEADROOM). */
static Py_ssize_t argmin_saving(Core *self, int64_t t, const int64_t *sav, int64_t *uncached_out) {
    const Py_ssize_t n = self->n;
    const int64_t *tok = self->tokens, *bl = self->backlog;
    const int64_t *cap = self->key == KEY_HEADROOM ? self->capacity : NULL;
    const uint8_t *cand = self->candidate;
    Py_ssize_t i = self->rotate ? self->next_start : 0, best = -1;
    int64_t bk = 0, bt = 0, bu = 0;
    int bf = 0;
    if (i < 0 || i >= n) i = 0;
    for (Py_ssize_t k = 0; k < n; k++, i = (i + 1 == n) ? 0 : i + 1) {
        if (!cand[i]) continue;
        int64_t u = (sav && t > sav[i]) ? t - sav[i] : (sav ? 0 : t);
        int64_t key = sat_add(bl[i], u), tt = tok[i];
        int full = 0;
        if (cap && cap[i] > 0) {
            int64_t need = sat_add(tt, u);
            if (need > cap[i]) {
                full = 1;
                key = need;
            }
        }
        if (best < 0 || full < bf || (full == bf && (key < bk || (key == bk && tt < bt)))) {
            best = i;
            bf = full;
            bk = key;
            bt = tt;
            bu = u;
        }
    }
    if (best >= 0) *uncached_out = bu;
    return settle_pick(self, best);
}

/* pick_saving(req, savings) -> (rank, charged): routed_dp_rank first, else argmin_saving; the rank
   is charged the uncached tokens (the prefill work the request adds there). */
static PyObject *core_pick_saving(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pick_saving(req, savings) takes 2 arguments");
        return NULL;
    }
    if (self->backlog == NULL) {
        PyErr_SetString(PyExc_ValueError, "pick_saving needs the backlog array (queued prefill tokens per rank)");
        return NULL;
    }
    Py_buffer sb;
    if (PyObject_GetBuffer(args[1], &sb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (sb.itemsize != 8 || !format_ok(sb.format, 8) || sb.len < self->n * 8) {
        PyErr_Format(PyExc_ValueError, "savings must be int64, one per rank (%zd), got %zd bytes of %zd-byte items",
                     self->n, sb.len, sb.itemsize);
        PyBuffer_Release(&sb);
        return NULL;
    }
    const int64_t *sav = (const int64_t *)sb.buf;
    Py_ssize_t rank;
    int64_t u = 0;
    int routed = request_routed(self, args[0], &rank);
    int64_t t = routed < 0 ? -1 : request_tokens(args[0]);
    if (t >= 0) {
        if (routed) u = t > sav[rank] ? t - sav[rank] : 0;
        else if (self->key == KEY_LOCKSTEP) rank = argmin_lockstep(self, t, sav, &u);
        else rank = argmin_saving(self, t, sav, &u);
    }
    PyBuffer_Release(&sb);
    if (t < 0 || rank < 0) return NULL;
    charge(self, rank, u);
    return Py_BuildValue("(nL)", rank, (long long)u);
}

static PyObject *core_pick_tokens(Core *self, PyObject *arg) {
    long long t = PyLong_AsLongLong(arg);
    if (t == -1 && PyErr_Occurred()) return NULL;
    if (t < 0 || t > MAX_REQUEST_TOKENS) {
        PyErr_Format(InvalidInputError, "estimated tokens must be in [0, %lld], got %lld", (long long)MAX_REQUEST_TOKENS, t);
        return NULL;
    }
    Py_ssize_t rank = argmin_key(self, (int64_t)t);
    if (rank < 0) return NULL;
    charge(self, rank, (int64_t)t);
    return PyLong_FromSsize_t(rank);
}

/* The (rank, tokens) arguments of charge() and retract(), checked. */
static int rank_tokens_args(Core *self, const char *name, PyObject *const *args, Py_ssize_t nargs,
                            Py_ssize_t *rank, int64_t *tokens) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(rank, tokens) takes 2 arguments", name);
        return -1;
    }
    Py_ssize_t r = PyLong_AsSsize_t(args[0]);
    if (r == -1 && PyErr_Occurred()) return -1;
    long long t = PyLong_AsLongLong(args[1]);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (r < 0 || r >= self->n || t < 0 || t > MAX_REQUEST_TOKENS) {
        PyErr_Format(InvalidInputError, "%s(rank, tokens) needs 0 <= rank < %zd and 0 <= tokens <= %lld", name,
                     self->n, (long long)MAX_REQUEST_TOKENS);
        return -1;
    }
    *rank = r;
    *tokens = (int64_t)t;
    return 0;
}

static PyObject *core_charge(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t r;
    int64_t t;
    if (rank_tokens_args(self, "charge", args, nargs, &r, &t) < 0) return NULL;
    charge(self, r, t);
    Py_RETURN_NONE;
}

/* Undo the latest charge of `tokens` to `rank`: the request never left (its send failed). */
static PyObject *core_retract(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t r;
    int64_t t;
    if (rank_tokens_args(self, "retract", args, nargs, &r, &t) < 0) return NULL;
    if (self->sent_reqs[r] < 1 || self->sent_tokens[r] < t) {
        PyErr_Format(InvalidInputError,
                     "retract(%zd, %lld): rank %zd has no such send in its ledger (%lld sends, %lld tokens); "
                     "retract only a pick that was charged",
                     r, (long long)t, r, (long long)self->sent_reqs[r], (long long)self->sent_tokens[r]);
        return NULL;
    }
    uncharge(self, r, t);
    Py_RETURN_NONE;
}

static PyObject *core_get_next_start(Core *self, void *c) { return PyLong_FromSsize_t(self->next_start); }
static int core_set_next_start(Core *self, PyObject *v, void *c) {
    Py_ssize_t s = v ? PyLong_AsSsize_t(v) : -1;
    if (s == -1 && PyErr_Occurred()) return -1;
    if (s < 0 || s >= self->n) {
        PyErr_Format(PyExc_ValueError, "next_start must be in [0, %zd)", self->n);
        return -1;
    }
    self->next_start = s;
    return 0;
}
static PyObject *core_get_n(Core *self, void *c) { return PyLong_FromSsize_t(self->n); }
static PyObject *core_get_key(Core *self, void *c) { return PyLong_FromLong(self->key); }
static int core_set_key(Core *self, PyObject *v, void *c) {
    long key = v ? PyLong_AsLong(v) : -1;
    if (key == -1 && PyErr_Occurred()) return -1;
    if (check_key(self, key) < 0) return -1;
    self->key = (int)key;
    return 0;
}
/* The throttle's two doubles (last_refresh, interval): `offset` is the field's offset in Core. */
static PyObject *core_get_double(Core *self, void *offset) {
    return PyFloat_FromDouble(*(double *)((char *)self + (size_t)offset));
}
static int core_set_double(Core *self, PyObject *v, void *offset) {
    if (v == NULL) {
        PyErr_SetString(PyExc_TypeError, "the throttle's figures cannot be deleted");
        return -1;
    }
    double t = PyFloat_AsDouble(v);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    *(double *)((char *)self + (size_t)offset) = t;
    return 0;
}

static PyObject *core_get_horizon(Core *self, void *c) { return PyLong_FromLongLong(self->horizon); }
static int core_set_horizon(Core *self, PyObject *v, void *c) {
    long long h = v ? PyLong_AsLongLong(v) : -1;
    if (h == -1 && PyErr_Occurred()) return -1;
    if (h < 0) {
        PyErr_SetString(PyExc_ValueError, "horizon must be >= 0 group steps");
        return -1;
    }
    self->horizon = (int64_t)h;
    return 0;
}

static PyMethodDef core_methods[] = {
    {"pick", (PyCFunction)core_pick, METH_O, "pick(req) -> rank: routed rank or argmin, charged."},
    {"pick_fresh", (PyCFunction)core_pick_fresh, METH_O,
     "pick_fresh(req) -> rank, or None when a refresh is due first (the throttle's clock read once)."},
    {"refresh_due", (PyCFunction)core_refresh_due, METH_NOARGS,
     "refresh_due() -> True when the throttle's interval has passed since the last refresh (now the last)."},
    {"pick_batch", (PyCFunction)core_pick_batch, METH_O,
     "pick_batch(reqs) -> list of ranks, with consecutive speculative charges; all or nothing."},
    {"pick_tokens", (PyCFunction)core_pick_tokens, METH_O, "pick_tokens(n) -> argmin rank, charged n tokens."},
    {"pick_saving", (PyCFunction)(void (*)(void))core_pick_saving, METH_FASTCALL,
     "pick_saving(req, savings) -> (rank, charged): the inflight_cache pick, charged the uncached tokens."},
    {"charge", (PyCFunction)(void (*)(void))core_charge, METH_FASTCALL,
     "charge(rank, tokens): add one request of that many tokens to rank."},
    {"retract", (PyCFunction)(void (*)(void))core_retract, METH_FASTCALL,
     "retract(rank, tokens): undo the latest charge of that many tokens to rank (a send that failed)."},
    {NULL},
};

static PyGetSetDef core_getset[] = {
    {"next_start", (getter)core_get_next_start, (setter)core_set_next_start, "where the next tie scan starts", NULL},
    {"n", (getter)core_get_n, NULL, "number of ranks", NULL},
    {"key", (getter)core_get_key, (setter)core_set_key,
     "the argmin key, one of the KEY_* constants (dpboard.methods.ArgminKey)", NULL},
    {"last_refresh", (getter)core_get_double, (setter)core_set_double,
     "the clock's reading at the last refresh (-inf: none yet)", (void *)offsetof(Core, last_refresh)},
    {"interval", (getter)core_get_double, (setter)core_set_double, "seconds between two refreshes at least",
     (void *)offsetof(Core, interval)},
    {"horizon", (getter)core_get_horizon, (setter)core_set_horizon,
     "inflight_lockstep: group steps to the first token any rank may take", NULL},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpboard.controller._dispatch.ArgminCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_doc = "Argmin and speculative charge over a DPBudget's arrays (changed in place).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_getset = core_getset,
};

static struct PyModuleDef dispatch_module = {
    PyModuleDef_HEAD_INIT, "dpboard.controller._dispatch", "Per-request dispatch core (see the source).", -1, NULL,
};

PyMODINIT_FUNC PyInit__dispatch(void) {
    s_routed_dp_rank = PyUnicode_InternFromString("routed_dp_rank");
    s_input_ids = PyUnicode_InternFromString("input_ids");
    s_num_tokens = PyUnicode_InternFromString("num_tokens");
    if (!s_routed_dp_rank || !s_input_ids || !s_num_tokens) return NULL;
    PyObject *errors = PyImport_ImportModule("dpboard.errors");
    if (errors == NULL) return NULL;
    InvalidInputError = PyObject_GetAttrString(errors, "InvalidInputError");
    UnavailableError = PyObject_GetAttrString(errors, "UnavailableError");
    Py_DECREF(errors);
    if (InvalidInputError == NULL || UnavailableError == NULL) return NULL;
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&dispatch_module);
    if (m == NULL) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "ArgminCore", (PyObject *)&CoreType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REQUEST_TOKENS", (long)MAX_REQUEST_TOKENS) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    for (int k = 0; k < NUM_KEYS; k++) {
        if (PyModule_AddIntConstant(m, KEYS[k].name, k) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
