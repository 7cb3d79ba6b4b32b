/* Suffix index over token streams for the `suffix` drafter; twin: edgespec/suffix_index.py
 * (PySuffixIndex: same behaviour, same tests). The specification and the data structure are
 * described in that module's docstring; this file follows it step for step.
 *
 * Layout:
 *   - tokens: every held token in one int32 buffer; global position g lives at
 *     toks[g - tbase]. Documents are consecutive ranges; eviction drops the oldest ones, so the
 *     held range [lo, tend) only loses its front (the buffer is compacted lazily).
 *   - nodes: an arena of fixed-size records (Node) with a free list; node 0 is the root.
 *     Children are found through one open-addressing hash table keyed by (parent, first token)
 *     and enumerated through a doubly linked sibling list.
 *   - the active document keeps the end node of each of its last D-1 windows (ends[]).
 *
 * Memory is reserved before each token is inserted, so an allocation failure leaves the index
 * consistent (holding a prefix of the tokens of the failed call). All arithmetic on scores is
 * the twin's: score(child) = score(parent) * ((double)count / (double)total).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NIL UINT32_MAX
#define ROOT 0u
#define MAX_DEPTH_LIMIT 1024
#define MAX_SPEC_LIMIT 65536
#define MAX_HISTORY_LIMIT ((long long)1 << 62)
#define MAX_NODES (UINT32_MAX - 2u)

typedef struct {
    int64_t pos;          /* start of the newest window through this node (global position) */
    uint32_t parent;
    uint32_t count;       /* windows through this node = occurrences of its string */
    uint32_t depth;       /* length of its string */
    uint32_t child;       /* first child */
    uint32_t next, prev;  /* siblings; `next` links the free list */
    int32_t tok;          /* first token of the edge into this node */
} Node;

typedef struct {
    uint32_t parent;      /* NIL: empty slot */
    int32_t tok;
    uint32_t child;
} Slot;

typedef struct {
    int64_t start, len;
} Doc;

typedef struct {
    double score;
    uint32_t depth;       /* depth in the draft tree */
    int32_t tok;
    int32_t parent;       /* index of the parent in the draft, -1 for the root */
    uint32_t node, d;     /* locus of the candidate's string: node, string length */
} Cand;

typedef struct {
    PyObject_HEAD
    uint32_t D;
    int64_t H, max_spec;
    double alpha, min_prob;
    /* tokens */
    int32_t *toks;
    int64_t tcap, tbase, tend, lo;
    /* finished documents, oldest first: docs[dhead .. dtail) */
    Doc *docs;
    int64_t dcap, dhead, dtail;
    int has_active;
    int64_t active_start;
    /* nodes */
    Node *nodes;
    uint32_t ncap, nused, nlive, nfree, freelist;
    Slot *slots;
    uint64_t scap, scount;
    uint32_t *ends, nends;
    uint32_t *path;       /* scratch, D entries */
} SuffixIndex;

/* ---- hash table (parent, token) -> child; linear probing, backward-shift deletion ---- */

static inline uint64_t hkey(uint32_t p, int32_t t) {
    uint64_t x = ((uint64_t)p << 32) | (uint32_t)t;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline uint32_t h_get(const SuffixIndex *s, uint32_t p, int32_t t) {
    uint64_t mask = s->scap - 1, i = hkey(p, t) & mask;
    for (;;) {
        const Slot *e = &s->slots[i];
        if (e->parent == NIL) return NIL;
        if (e->parent == p && e->tok == t) return e->child;
        i = (i + 1) & mask;
    }
}

/* Inserts or overwrites; room must have been reserved. */
static inline void h_put(SuffixIndex *s, uint32_t p, int32_t t, uint32_t c) {
    uint64_t mask = s->scap - 1, i = hkey(p, t) & mask;
    for (;;) {
        Slot *e = &s->slots[i];
        if (e->parent == NIL) {
            e->parent = p;
            e->tok = t;
            e->child = c;
            s->scount++;
            return;
        }
        if (e->parent == p && e->tok == t) {
            e->child = c;
            return;
        }
        i = (i + 1) & mask;
    }
}

static void h_del(SuffixIndex *s, uint32_t p, int32_t t) {
    uint64_t mask = s->scap - 1, i = hkey(p, t) & mask;
    for (;;) {
        Slot *e = &s->slots[i];
        if (e->parent == NIL) return;
        if (e->parent == p && e->tok == t) break;
        i = (i + 1) & mask;
    }
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Slot *e = &s->slots[j];
        if (e->parent == NIL) break;
        uint64_t k = hkey(e->parent, e->tok) & mask;
        /* the entry at j may move to i unless its home k lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        s->slots[i] = *e;
        i = j;
    }
    s->slots[i].parent = NIL;
    s->scount--;
}

static int h_resize(SuffixIndex *s, uint64_t cap) {
    if (cap > (uint64_t)PY_SSIZE_T_MAX / sizeof(Slot)) { PyErr_NoMemory(); return -1; }
    Slot *ns = (Slot *)PyMem_RawMalloc(cap * sizeof(Slot));
    if (!ns) { PyErr_NoMemory(); return -1; }
    for (uint64_t i = 0; i < cap; i++) ns[i].parent = NIL;
    Slot *old = s->slots;
    uint64_t oldcap = s->scap;
    s->slots = ns;
    s->scap = cap;
    s->scount = 0;
    for (uint64_t i = 0; i < oldcap; i++)
        if (old[i].parent != NIL) h_put(s, old[i].parent, old[i].tok, old[i].child);
    PyMem_RawFree(old);
    return 0;
}

/* ---- node arena ---- */

/* Room for n more nodes (and their hash entries) without reallocating. */
static int reserve_nodes(SuffixIndex *s, uint32_t n) {
    uint64_t avail = (uint64_t)(s->ncap - s->nused) + s->nfree;
    if (avail < n) {
        uint64_t want = (uint64_t)s->nused + n, cap = (uint64_t)s->ncap * 2;
        if (cap < want) cap = want;
        if (cap < 64) cap = 64;
        if (cap > MAX_NODES) cap = MAX_NODES;
        if (cap < want) { PyErr_SetString(PyExc_MemoryError, "suffix index: too many nodes"); return -1; }
        if (cap > (uint64_t)PY_SSIZE_T_MAX / sizeof(Node)) { PyErr_NoMemory(); return -1; }
        Node *nn = (Node *)PyMem_RawRealloc(s->nodes, cap * sizeof(Node));
        if (!nn) { PyErr_NoMemory(); return -1; }
        s->nodes = nn;
        s->ncap = (uint32_t)cap;
    }
    /* load factor at most 0.7 */
    if ((s->scount + n) * 10 > s->scap * 7) {
        uint64_t cap = s->scap;
        while ((s->scount + n) * 10 > cap * 7) cap *= 2;
        if (h_resize(s, cap) < 0) return -1;
    }
    return 0;
}

static inline uint32_t node_new(SuffixIndex *s, uint32_t parent, int32_t tok, uint32_t count,
                                uint32_t depth, int64_t pos) {
    uint32_t y;
    if (s->freelist != NIL) {
        y = s->freelist;
        s->freelist = s->nodes[y].next;
        s->nfree--;
    } else {
        y = s->nused++;
    }
    Node *n = &s->nodes[y];
    n->pos = pos;
    n->parent = parent;
    n->count = count;
    n->depth = depth;
    n->child = n->next = n->prev = NIL;
    n->tok = tok;
    s->nlive++;
    return y;
}

static inline void node_free(SuffixIndex *s, uint32_t x) {
    Node *n = &s->nodes[x];
    n->parent = NIL;
    n->child = NIL;
    n->count = 0;
    n->next = s->freelist;
    s->freelist = x;
    s->nfree++;
    s->nlive--;
}

static inline void link_child(SuffixIndex *s, uint32_t p, uint32_t c) {
    Node *N = s->nodes;
    N[c].prev = NIL;
    N[c].next = N[p].child;
    if (N[p].child != NIL) N[N[p].child].prev = c;
    N[p].child = c;
    N[c].parent = p;
}

static inline void unlink_child(SuffixIndex *s, uint32_t c) {
    Node *N = s->nodes;
    uint32_t p = N[c].parent;
    if (N[c].prev != NIL) N[N[c].prev].next = N[c].next;
    else N[p].child = N[c].next;
    if (N[c].next != NIL) N[N[c].next].prev = N[c].prev;
    N[c].next = N[c].prev = NIL;
}

/* `nw` takes the place of `old` in the child list of old's parent. */
static inline void replace_child(SuffixIndex *s, uint32_t old, uint32_t nw) {
    Node *N = s->nodes;
    uint32_t p = N[old].parent;
    N[nw].prev = N[old].prev;
    N[nw].next = N[old].next;
    if (N[nw].prev != NIL) N[N[nw].prev].next = nw;
    else N[p].child = nw;
    if (N[nw].next != NIL) N[N[nw].next].prev = nw;
    N[nw].parent = p;
    N[old].prev = N[old].next = NIL;
}

static inline int32_t tok_at(const SuffixIndex *s, int64_t g) { return s->toks[g - s->tbase]; }

/* Removes x when it has one child of the same count (no window ends at x). */
static void maybe_merge(SuffixIndex *s, uint32_t x) {
    if (x == ROOT) return;
    Node *N = s->nodes;
    uint32_t c = N[x].child;
    if (c == NIL || N[c].next != NIL || N[c].count != N[x].count) return;
    uint32_t p = N[x].parent;
    int32_t t = N[x].tok;
    h_del(s, x, N[c].tok);
    replace_child(s, x, c);
    N[c].tok = t;
    h_put(s, p, t, c);
    node_free(s, x);
}

/* Moves window i (ending at node x, depth k) one token t down; returns its new end node.
 * Needs one reserved node. */
static uint32_t step(SuffixIndex *s, uint32_t x, uint32_t k, int32_t t, int64_t i) {
    Node *N = s->nodes;
    if (N[x].child == NIL && x != ROOT && N[x].count == 1) { /* a leaf of window i alone */
        N[x].depth++;
        return x;
    }
    uint32_t v = h_get(s, x, t), y;
    if (v == NIL) {
        y = node_new(s, x, t, 1, k + 1, i);
        link_child(s, x, y);
        h_put(s, x, t, y);
        return y; /* x gained a child of count 1 < count(x): not redundant */
    }
    if (N[v].depth == k + 1) {
        N[v].count++;
        if (N[v].pos < i) N[v].pos = i;
        y = v;
    } else if (x != ROOT && N[x].child == v && N[v].next == NIL && N[x].count == N[v].count + 1) {
        /* x only marks where window i ends, above one edge: slide it one token down the edge,
         * the trie a split and x's merge would leave, with two hash edits instead of four
         * (13 tokens of text copied from the history: 61 -> 40 us) */
        int64_t pv = N[v].pos;
        int32_t nt = tok_at(s, pv + k + 1);
        h_del(s, x, t);
        N[x].depth = k + 1;
        N[x].pos = pv > i ? pv : i;
        N[v].tok = nt;
        h_put(s, x, nt, v);
        return x;
    } else { /* split the edge into v at depth k + 1 */
        int64_t pv = N[v].pos;
        y = node_new(s, x, t, N[v].count + 1, k + 1, pv > i ? pv : i);
        replace_child(s, v, y);
        h_put(s, x, t, y);
        int32_t nt = tok_at(s, pv + k + 1);
        N[v].tok = nt;
        link_child(s, y, v);
        h_put(s, y, nt, v);
    }
    maybe_merge(s, x);
    return y;
}

/* ---- tokens and documents ---- */

static void compact_tokens(SuffixIndex *s) {
    int64_t held = s->tend - s->lo;
    if (s->lo > s->tbase) {
        memmove(s->toks, s->toks + (s->lo - s->tbase), (size_t)held * sizeof(int32_t));
        s->tbase = s->lo;
    }
}

/* Room for n more tokens. The dead prefix (evicted documents) is dropped when it is at least
 * half the held tokens, so each compaction moves at most twice what it frees. */
static int reserve_tokens(SuffixIndex *s, int64_t n) {
    int64_t held = s->tend - s->lo, dead = s->lo - s->tbase;
    if (s->tend - s->tbase + n <= s->tcap) return 0;
    if (dead > 0 && dead * 2 >= held && held + n <= s->tcap) {
        compact_tokens(s);
        return 0;
    }
    int64_t cap = s->tcap * 2;
    if (cap < held + n) cap = held + n;
    if (cap < 1024) cap = 1024;
    if ((uint64_t)cap > (uint64_t)PY_SSIZE_T_MAX / sizeof(int32_t)) { PyErr_NoMemory(); return -1; }
    int32_t *nt = (int32_t *)PyMem_RawRealloc(s->toks, (size_t)cap * sizeof(int32_t));
    if (!nt) { PyErr_NoMemory(); return -1; }
    s->toks = nt;
    s->tcap = cap;
    compact_tokens(s);
    return 0;
}

static int push_doc(SuffixIndex *s, int64_t start, int64_t len) {
    if (s->dtail == s->dcap) {
        if (s->dhead > 0) {
            memmove(s->docs, s->docs + s->dhead, (size_t)(s->dtail - s->dhead) * sizeof(Doc));
            s->dtail -= s->dhead;
            s->dhead = 0;
        }
        if (s->dtail == s->dcap) {
            int64_t cap = s->dcap ? s->dcap * 2 : 16;
            Doc *nd = (Doc *)PyMem_RawRealloc(s->docs, (size_t)cap * sizeof(Doc));
            if (!nd) { PyErr_NoMemory(); return -1; }
            s->docs = nd;
            s->dcap = cap;
        }
    }
    s->docs[s->dtail].start = start;
    s->docs[s->dtail].len = len;
    s->dtail++;
    return 0;
}

static int close_active(SuffixIndex *s) {
    if (!s->has_active) return 0;
    int64_t n = s->tend - s->active_start;
    if (n > 0 && push_doc(s, s->active_start, n) < 0) return -1;
    s->has_active = 0;
    s->nends = 0;
    return 0;
}

static int evict_doc(SuffixIndex *s, int64_t start, int64_t len) {
    Node *N = s->nodes;
    int64_t end = start + len;
    for (int64_t i = start; i < end; i++) {
        uint32_t L = (end - i < (int64_t)s->D) ? (uint32_t)(end - i) : s->D;
        uint32_t u = ROOT, d = 0, np = 0;
        while (d < L) {
            uint32_t v = h_get(s, u, tok_at(s, i + d));
            if (v == NIL || N[v].depth > L || N[v].depth <= d || np >= s->D) {
                PyErr_SetString(PyExc_SystemError, "suffix index: corrupt trie during eviction");
                return -1;
            }
            s->path[np++] = v;
            d = N[v].depth;
            u = v;
        }
        int64_t fz = -1;
        for (uint32_t q = 0; q < np; q++)
            if (--N[s->path[q]].count == 0 && fz < 0) fz = q;
        if (fz >= 0) {
            uint32_t f = s->path[fz], par = N[f].parent;
            unlink_child(s, f);
            for (uint32_t q = (uint32_t)fz; q < np; q++) {
                uint32_t v = s->path[q];
                h_del(s, N[v].parent, N[v].tok);
                node_free(s, v);
            }
            maybe_merge(s, par);
        } else if (np) {
            maybe_merge(s, s->path[np - 1]);
        }
    }
    return 0;
}

static int evict_for(SuffixIndex *s, int64_t extra) {
    while (s->dhead < s->dtail && (s->tend - s->lo) + extra > s->H) {
        Doc d = s->docs[s->dhead];
        if (evict_doc(s, d.start, d.len) < 0) return -1;
        s->dhead++;
        s->lo = d.start + d.len;
    }
    if (s->dhead == s->dtail) s->dhead = s->dtail = 0;
    return 0;
}

static int append_tokens(SuffixIndex *s, const int32_t *t, Py_ssize_t n) {
    if (reserve_tokens(s, n) < 0) return -1;
    for (Py_ssize_t q = 0; q < n; q++) {
        if (reserve_nodes(s, s->D + 1) < 0) return -1;
        int64_t p = s->tend;
        s->toks[p - s->tbase] = t[q];
        s->tend++;
        uint32_t ne = 0, nends = s->nends;
        for (uint32_t j = 0; j < nends; j++) {
            uint32_t k = nends - j;
            uint32_t y = step(s, s->ends[j], k, t[q], p - k);
            if (k + 1 < s->D) s->ends[ne++] = y;
        }
        s->ends[ne++] = step(s, ROOT, 0, t[q], p);
        s->nends = ne;
    }
    return 0;
}

/* ---- reading token sequences ---- */

static int fmt_is_signed_int(const char *f, Py_ssize_t itemsize) {
    if (!f) return 0; /* "B" */
    if (*f == '<' || *f == '=' || *f == '@' || *f == '!' || *f == '>') {
#if PY_LITTLE_ENDIAN
        if (*f == '>' || *f == '!') return 0;
#else
        if (*f == '<') return 0;
#endif
        f++;
    }
    if (f[0] == '\0' || f[1] != '\0') return 0;
    switch (f[0]) {
    case 'i': case 'l': case 'q': case 'n': case 'h': case 'b':
        return itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8;
    default:
        return 0;
    }
}

static int i64_to_i32(long long v, int32_t *out) {
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "token id outside int32");
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* The last `tail` (or all, tail < 0) items of obj as int32, in a PyMem_RawMalloc'd buffer. */
static int read_tokens(PyObject *obj, Py_ssize_t tail, int32_t **out, Py_ssize_t *n_out) {
    *out = NULL;
    *n_out = 0;
    Py_buffer view;
    if (!PyUnicode_Check(obj) && PyObject_CheckBuffer(obj) &&
        PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        if (view.ndim == 1 && fmt_is_signed_int(view.format, view.itemsize)) {
            Py_ssize_t n = view.len / view.itemsize, from = (tail >= 0 && n > tail) ? n - tail : 0;
            int32_t *buf = (int32_t *)PyMem_RawMalloc((size_t)(n - from + 1) * sizeof(int32_t));
            if (!buf) { PyBuffer_Release(&view); PyErr_NoMemory(); return -1; }
            for (Py_ssize_t q = from; q < n; q++) {
                long long v;
                const char *p = (const char *)view.buf + q * view.itemsize;
                switch (view.itemsize) {
                case 1: v = *(const int8_t *)p; break;
                case 2: { int16_t x; memcpy(&x, p, 2); v = x; break; }
                case 4: { int32_t x; memcpy(&x, p, 4); v = x; break; }
                default: { int64_t x; memcpy(&x, p, 8); v = x; break; }
                }
                if (i64_to_i32(v, &buf[q - from]) < 0) {
                    PyMem_RawFree(buf);
                    PyBuffer_Release(&view);
                    return -1;
                }
            }
            PyBuffer_Release(&view);
            *out = buf;
            *n_out = n - from;
            return 0;
        }
        PyBuffer_Release(&view);
    } else {
        PyErr_Clear();
    }
    PyObject *seq = PySequence_Fast(obj, "token ids must be a sequence of integers");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), from = (tail >= 0 && n > tail) ? n - tail : 0;
    int32_t *buf = (int32_t *)PyMem_RawMalloc((size_t)(n - from + 1) * sizeof(int32_t));
    if (!buf) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t q = from; q < n; q++) {
        /* re-read the size: __index__ may run Python code that mutates a list */
        if (q >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "token sequence changed size while being read");
            goto fail;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(seq, q);
        Py_INCREF(item);
        PyObject *idx = PyNumber_Index(item);
        Py_DECREF(item);
        if (!idx) goto fail;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
        Py_DECREF(idx);
        if (v == -1 && PyErr_Occurred()) goto fail;
        if (overflow) {
            PyErr_SetString(PyExc_OverflowError, "token id outside int32");
            goto fail;
        }
        if (i64_to_i32(v, &buf[q - from]) < 0) goto fail;
    }
    Py_DECREF(seq);
    *out = buf;
    *n_out = n - from;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_RawFree(buf);
    return -1;
}

/* ---- Python type ---- */

static long long as_ll_in(PyObject *o, const char *name, long long lo, long long hi, int *err) {
    PyObject *idx = PyNumber_Index(o);
    if (!idx) { *err = 1; return 0; }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) { *err = 1; return 0; }
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be in [%lld, %lld]", name, lo, hi);
        *err = 1;
        return 0;
    }
    return v;
}

static double as_double_in(PyObject *o, const char *name, double lo, double hi, const char *range,
                           int *err) {
    if (PyUnicode_Check(o) || PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a real number", name);
        *err = 1;
        return 0;
    }
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) { *err = 1; return 0; }
    if (!(lo <= v && v <= hi)) {
        PyErr_Format(PyExc_ValueError, "%s must be in %s", name, range);
        *err = 1;
        return 0;
    }
    return v;
}

static void SuffixIndex_dealloc(SuffixIndex *s) {
    PyMem_RawFree(s->toks);
    PyMem_RawFree(s->docs);
    PyMem_RawFree(s->nodes);
    PyMem_RawFree(s->slots);
    PyMem_RawFree(s->ends);
    PyMem_RawFree(s->path);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *SuffixIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_depth", "max_history_tokens", "max_spec", "alpha", "min_prob", NULL};
    PyObject *o_depth = NULL, *o_hist = NULL, *o_spec = NULL, *o_alpha = NULL, *o_minp = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OOOOO", kwlist, &o_depth, &o_hist, &o_spec,
                                     &o_alpha, &o_minp))
        return NULL;
    int err = 0;
    long long D = o_depth ? as_ll_in(o_depth, "max_depth", 2, MAX_DEPTH_LIMIT, &err) : 32;
    if (err) return NULL;
    long long H = o_hist ? as_ll_in(o_hist, "max_history_tokens", 0, MAX_HISTORY_LIMIT, &err) : (1 << 20);
    if (err) return NULL;
    long long ms = o_spec ? as_ll_in(o_spec, "max_spec", 0, MAX_SPEC_LIMIT, &err) : 32;
    if (err) return NULL;
    double alpha = o_alpha ? as_double_in(o_alpha, "alpha", 0.0, 1e9, "[0, 1e9]", &err) : 1.0;
    if (err) return NULL;
    double minp = o_minp ? as_double_in(o_minp, "min_prob", 0.0, 1.0, "[0, 1]", &err) : 0.1;
    if (err) return NULL;

    SuffixIndex *s = (SuffixIndex *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    s->D = (uint32_t)D;
    s->H = H;
    s->max_spec = ms;
    s->alpha = alpha;
    s->min_prob = minp;
    s->freelist = NIL;
    s->ends = (uint32_t *)PyMem_RawMalloc(sizeof(uint32_t) * (size_t)D);
    s->path = (uint32_t *)PyMem_RawMalloc(sizeof(uint32_t) * (size_t)D);
    s->slots = (Slot *)PyMem_RawMalloc(sizeof(Slot) * 128);
    if (!s->ends || !s->path || !s->slots) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    s->scap = 128;
    for (uint64_t i = 0; i < s->scap; i++) s->slots[i].parent = NIL;
    if (reserve_nodes(s, 64) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    node_new(s, NIL, 0, 0, 0, 0); /* the root */
    return (PyObject *)s;
}

static PyObject *SuffixIndex_add_document(SuffixIndex *s, PyObject *arg) {
    int32_t *t;
    Py_ssize_t n;
    if (read_tokens(arg, -1, &t, &n) < 0) return NULL;
    int rc = close_active(s);
    if (rc == 0) rc = evict_for(s, n);
    if (rc == 0) {
        s->has_active = 1;
        s->active_start = s->tend;
        s->nends = 0;
        rc = append_tokens(s, t, n);
    }
    PyMem_RawFree(t);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *SuffixIndex_extend(SuffixIndex *s, PyObject *arg) {
    int32_t *t;
    Py_ssize_t n;
    if (read_tokens(arg, -1, &t, &n) < 0) return NULL;
    int rc = evict_for(s, n);
    if (rc == 0) {
        if (!s->has_active) {
            s->has_active = 1;
            s->active_start = s->tend;
            s->nends = 0;
        }
        rc = append_tokens(s, t, n);
    }
    PyMem_RawFree(t);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *SuffixIndex_end_document(SuffixIndex *s, PyObject *Py_UNUSED(ignored)) {
    if (close_active(s) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Locus of seq[0:n]: node v and depth n with depth(parent(v)) < n <= depth(v); 0 if absent. */
static int find(const SuffixIndex *s, const int32_t *seq, uint32_t n, uint32_t *node) {
    const Node *N = s->nodes;
    uint32_t u = ROOT, d = 0;
    while (d < n) {
        uint32_t v = h_get(s, u, seq[d]);
        if (v == NIL) return 0;
        uint32_t e = N[v].depth < n ? N[v].depth : n;
        const int32_t *lab = s->toks + (N[v].pos - s->tbase);
        for (uint32_t j = d + 1; j < e; j++)
            if (lab[j] != seq[j]) return 0;
        d = e;
        u = v;
    }
    *node = u;
    return 1;
}

static inline int has_continuation(const SuffixIndex *s, uint32_t v, uint32_t d) {
    return d < s->nodes[v].depth || s->nodes[v].child != NIL;
}

/* a before b in the best-first order */
static inline int cand_before(const Cand *a, const Cand *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->depth != b->depth) return a->depth < b->depth;
    if (a->tok != b->tok) return a->tok < b->tok;
    return a->parent < b->parent;
}

typedef struct {
    Cand *a;
    size_t n, cap;
} Heap;

static int heap_push(Heap *h, Cand c) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        Cand *na = (Cand *)PyMem_RawRealloc(h->a, cap * sizeof(Cand));
        if (!na) { PyErr_NoMemory(); return -1; }
        h->a = na;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_before(&c, &h->a[p])) break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i] = c;
    return 0;
}

static Cand heap_pop(Heap *h) {
    Cand top = h->a[0], last = h->a[--h->n];
    size_t i = 0, n = h->n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, b = i;
        const Cand *best = &last;
        if (l < n && cand_before(&h->a[l], best)) { b = l; best = &h->a[l]; }
        if (r < n && cand_before(&h->a[r], best)) { b = r; }
        if (b == i) break;
        h->a[i] = h->a[b];
        i = b;
    }
    if (n) h->a[i] = last;
    return top;
}

/* Pushes the children of locus (v, d) as candidates at draft depth `depth` under node `idx`. */
static int push_children(const SuffixIndex *s, Heap *h, uint32_t L, uint32_t v, uint32_t d,
                         double score, uint32_t depth, int32_t idx) {
    const Node *N = s->nodes;
    if ((uint64_t)L + depth > s->D) return 0;
    if (d < N[v].depth) {
        double c = (double)N[v].count;
        double sc = score * (c / c);
        if (sc >= s->min_prob) {
            Cand k = {sc, depth, tok_at(s, N[v].pos + d), idx, v, d + 1};
            return heap_push(h, k);
        }
        return 0;
    }
    uint64_t total = 0;
    for (uint32_t c = N[v].child; c != NIL; c = N[c].next) total += N[c].count;
    for (uint32_t c = N[v].child; c != NIL; c = N[c].next) {
        double sc = score * ((double)N[c].count / (double)total);
        if (sc >= s->min_prob) {
            Cand k = {sc, depth, N[c].tok, idx, c, d + 1};
            if (heap_push(h, k) < 0) return -1;
        }
    }
    return 0;
}

static PyObject *SuffixIndex_propose(SuffixIndex *s, PyObject *args) {
    PyObject *ctx, *o_budget;
    if (!PyArg_ParseTuple(args, "OO:propose", &ctx, &o_budget)) return NULL;
    int32_t *tail;
    Py_ssize_t nt;
    if (read_tokens(ctx, (Py_ssize_t)s->D - 1, &tail, &nt) < 0) return NULL;
    PyObject *bidx = PyNumber_Index(o_budget);
    if (!bidx) { PyMem_RawFree(tail); return NULL; }
    int overflow = 0;
    long long budget = PyLong_AsLongLongAndOverflow(bidx, &overflow);
    Py_DECREF(bidx);
    if (budget == -1 && PyErr_Occurred()) { PyMem_RawFree(tail); return NULL; }
    if (overflow > 0) budget = LLONG_MAX;
    if (overflow < 0) budget = LLONG_MIN;

    /* longest suffix with a continuation: the property is inherited by shorter suffixes */
    uint32_t lo = 0, hi = (uint32_t)nt, best = ROOT;
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2, v;
        if (find(s, tail + (nt - mid), mid, &v) && has_continuation(s, v, mid)) {
            lo = mid;
            best = v;
        } else {
            hi = mid - 1;
        }
    }
    uint32_t L = lo;
    long long n = 0;
    if (L > 0) {
        double x = s->alpha * (double)L;
        long long cap = x >= (double)s->max_spec ? s->max_spec : (long long)ceil(x);
        if (cap < 1) cap = 1;
        n = budget < cap ? budget : cap;
        if (n > s->max_spec) n = s->max_spec;
        if (n < 0) n = 0;
    }
    PyMem_RawFree(tail);

    Heap h = {NULL, 0, 0};
    int32_t *otok = NULL, *opar = NULL;
    double *osc = NULL;
    long long got = 0;
    if (n > 0) {
        otok = (int32_t *)PyMem_RawMalloc((size_t)n * sizeof(int32_t));
        opar = (int32_t *)PyMem_RawMalloc((size_t)n * sizeof(int32_t));
        osc = (double *)PyMem_RawMalloc((size_t)n * sizeof(double));
        if (!otok || !opar || !osc) { PyErr_NoMemory(); goto fail; }
        if (push_children(s, &h, L, best, L, 1.0, 1, -1) < 0) goto fail;
        while (h.n && got < n) {
            Cand c = heap_pop(&h);
            otok[got] = c.tok;
            opar[got] = c.parent;
            osc[got] = c.score;
            int32_t idx = (int32_t)got++;
            if (push_children(s, &h, L, c.node, c.d, c.score, c.depth + 1, idx) < 0) goto fail;
        }
    }
    PyObject *lt = PyList_New((Py_ssize_t)got), *lp = PyList_New((Py_ssize_t)got),
             *ls = PyList_New((Py_ssize_t)got), *res = NULL;
    if (lt && lp && ls) {
        for (long long q = 0; q < got; q++) {
            PyObject *a = PyLong_FromLong(otok[q]), *b = PyLong_FromLong(opar[q]),
                     *c = PyFloat_FromDouble(osc[q]);
            if (!a || !b || !c) {
                Py_XDECREF(a);
                Py_XDECREF(b);
                Py_XDECREF(c);
                goto out;
            }
            PyList_SET_ITEM(lt, q, a);
            PyList_SET_ITEM(lp, q, b);
            PyList_SET_ITEM(ls, q, c);
        }
        res = Py_BuildValue("(OOOI)", lt, lp, ls, L);
    }
out:
    Py_XDECREF(lt);
    Py_XDECREF(lp);
    Py_XDECREF(ls);
    PyMem_RawFree(h.a);
    PyMem_RawFree(otok);
    PyMem_RawFree(opar);
    PyMem_RawFree(osc);
    return res;
fail:
    PyMem_RawFree(h.a);
    PyMem_RawFree(otok);
    PyMem_RawFree(opar);
    PyMem_RawFree(osc);
    return NULL;
}

static PyObject *SuffixIndex_match(SuffixIndex *s, PyObject *ctx) {
    int32_t *tail;
    Py_ssize_t nt;
    if (read_tokens(ctx, (Py_ssize_t)s->D - 1, &tail, &nt) < 0) return NULL;
    uint32_t lo = 0, hi = (uint32_t)nt;
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2, v;
        if (find(s, tail + (nt - mid), mid, &v) && has_continuation(s, v, mid)) lo = mid;
        else hi = mid - 1;
    }
    PyMem_RawFree(tail);
    return PyLong_FromUnsignedLong(lo);
}

/* ---- integrity: recount every window of the held documents ---- */

static int64_t doc_end_of(const SuffixIndex *s, int64_t g) {
    if (s->has_active && g >= s->active_start && g < s->tend) return s->tend;
    int64_t a = s->dhead, b = s->dtail; /* last doc with start <= g */
    while (b - a > 1) {
        int64_t m = (a + b) / 2;
        if (s->docs[m].start <= g) a = m;
        else b = m;
    }
    if (a < s->dtail && s->docs[a].start <= g && g < s->docs[a].start + s->docs[a].len)
        return s->docs[a].start + s->docs[a].len;
    return -1;
}

#define FAIL(...) do { PyErr_Format(PyExc_RuntimeError, "suffix index integrity: " __VA_ARGS__); goto done; } while (0)

static int walk_window(SuffixIndex *s, int64_t i, int64_t doc_end, uint64_t *ends, int64_t *maxend,
                       uint32_t *term) {
    const Node *N = s->nodes;
    uint32_t L = (doc_end - i < (int64_t)s->D) ? (uint32_t)(doc_end - i) : s->D;
    uint32_t u = ROOT, d = 0;
    while (d < L) {
        uint32_t v = h_get(s, u, tok_at(s, i + d));
        if (v == NIL || v >= s->nused || N[v].parent != u || N[v].depth > L || N[v].depth <= d) {
            PyErr_Format(PyExc_RuntimeError, "suffix index integrity: window %lld has no path at depth %u",
                         (long long)i, d);
            return -1;
        }
        if (N[v].pos < s->lo || N[v].pos + N[v].depth > s->tend) {
            PyErr_Format(PyExc_RuntimeError, "suffix index integrity: node %u label not held", v);
            return -1;
        }
        for (uint32_t j = d + 1; j < N[v].depth; j++)
            if (tok_at(s, N[v].pos + j) != tok_at(s, i + j)) {
                PyErr_Format(PyExc_RuntimeError, "suffix index integrity: window %lld differs from node %u",
                             (long long)i, v);
                return -1;
            }
        d = N[v].depth;
        u = v;
    }
    ends[u]++;
    if (maxend[u] < i) maxend[u] = i;
    *term = u;
    return 0;
}

static PyObject *SuffixIndex_check_integrity(SuffixIndex *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *ret = NULL;
    const Node *N = s->nodes;
    size_t nn = s->nused ? s->nused : 1;
    uint64_t *ends = (uint64_t *)PyMem_RawCalloc(nn, sizeof(uint64_t));
    uint64_t *total = (uint64_t *)PyMem_RawCalloc(nn, sizeof(uint64_t));
    int64_t *maxend = (int64_t *)PyMem_RawMalloc(nn * sizeof(int64_t));
    int64_t *newest = (int64_t *)PyMem_RawMalloc(nn * sizeof(int64_t));
    uint32_t *order = (uint32_t *)PyMem_RawMalloc(nn * sizeof(uint32_t));
    uint8_t *seen = (uint8_t *)PyMem_RawCalloc(nn, 1);
    if (!ends || !total || !maxend || !newest || !order || !seen) { PyErr_NoMemory(); goto done; }
    for (size_t q = 0; q < nn; q++) maxend[q] = newest[q] = -1;

    /* documents cover [lo, tend) contiguously */
    int64_t at = s->lo;
    for (int64_t q = s->dhead; q < s->dtail; q++) {
        if (s->docs[q].start != at || s->docs[q].len <= 0) FAIL("documents not contiguous at %lld", (long long)at);
        at += s->docs[q].len;
    }
    if (s->has_active && s->active_start != at) FAIL("active document not after the history");
    if (s->has_active) at = s->tend;
    if (at != s->tend || s->lo < s->tbase || s->tend - s->tbase > s->tcap) FAIL("documents do not cover the held tokens");
    if (!s->has_active && s->nends) FAIL("window ends without an active document");

    for (int64_t q = s->dhead; q < s->dtail; q++) {
        int64_t e = s->docs[q].start + s->docs[q].len;
        for (int64_t i = s->docs[q].start; i < e; i++) {
            uint32_t term;
            if (walk_window(s, i, e, ends, maxend, &term) < 0) goto done;
        }
    }
    if (s->has_active) {
        int64_t first = s->tend - ((int64_t)s->D - 1);
        if (first < s->active_start) first = s->active_start;
        if ((int64_t)s->nends != s->tend - first) FAIL("%u window ends, expected %lld", s->nends, (long long)(s->tend - first));
        for (int64_t i = s->active_start; i < s->tend; i++) {
            uint32_t term;
            if (walk_window(s, i, s->tend, ends, maxend, &term) < 0) goto done;
            if (i >= first && s->ends[i - first] != term) FAIL("stale end of window %lld", (long long)i);
        }
    }

    /* traverse from the root */
    size_t no = 0, head = 0;
    order[no++] = ROOT;
    seen[ROOT] = 1;
    while (head < no) {
        uint32_t v = order[head++], prev = NIL;
        for (uint32_t c = N[v].child; c != NIL; c = N[c].next) {
            if (c >= s->nused || seen[c]) FAIL("node %u reached twice or out of range", c);
            if (N[c].parent != v || N[c].prev != prev) FAIL("node %u has wrong links", c);
            if (h_get(s, v, N[c].tok) != c) FAIL("node %u missing from the hash table", c);
            seen[c] = 1;
            order[no++] = c;
            prev = c;
        }
    }
    if (no != s->nlive) FAIL("%u nodes held, %zu reachable", s->nlive, no);
    if (s->scount != (uint64_t)s->nlive - 1) FAIL("%llu hash entries for %u nodes", (unsigned long long)s->scount, s->nlive);
    if ((uint64_t)s->nlive + s->nfree != s->nused) FAIL("free list count is off");
    {
        uint32_t k = 0;
        for (uint32_t f = s->freelist; f != NIL; f = N[f].next)
            if (++k > s->nfree || f >= s->nused || seen[f]) FAIL("free list corrupt");
        if (k != s->nfree) FAIL("free list length is off");
    }
    for (size_t q = no; q-- > 1;) {
        uint32_t v = order[q], p = N[v].parent;
        uint64_t c_v = ends[v] + total[v];
        int64_t m_v = maxend[v] > newest[v] ? maxend[v] : newest[v];
        if (N[v].count != c_v || c_v == 0) FAIL("node %u: count %u, recounted %llu", v, N[v].count, (unsigned long long)c_v);
        if (N[v].pos != m_v) FAIL("node %u: newest window %lld, recounted %lld", v, (long long)N[v].pos, (long long)m_v);
        if (!(N[p].depth < N[v].depth && N[v].depth <= s->D)) FAIL("node %u: bad depth", v);
        int64_t de = doc_end_of(s, N[v].pos);
        if (de < 0 || N[v].pos + N[v].depth > de) FAIL("node %u: label outside its document", v);
        if (tok_at(s, N[v].pos + N[p].depth) != N[v].tok) FAIL("node %u: key differs from its label", v);
        if (p != ROOT)
            for (uint32_t j = 0; j < N[p].depth; j++)
                if (tok_at(s, N[v].pos + j) != tok_at(s, N[p].pos + j)) FAIL("node %u: path differs from its parent's", v);
        uint32_t c = N[v].child;
        if (c != NIL && N[c].next == NIL && N[c].count == N[v].count) FAIL("node %u is redundant", v);
        total[p] += c_v;
        if (newest[p] < m_v) newest[p] = m_v;
    }
    ret = Py_True;
    Py_INCREF(ret);
done:
    PyMem_RawFree(ends);
    PyMem_RawFree(total);
    PyMem_RawFree(maxend);
    PyMem_RawFree(newest);
    PyMem_RawFree(order);
    PyMem_RawFree(seen);
    return ret;
}

static PyObject *SuffixIndex_documents(SuffixIndex *s, PyObject *Py_UNUSED(ignored)) {
    int64_t nd = s->dtail - s->dhead + (s->has_active ? 1 : 0);
    PyObject *out = PyList_New((Py_ssize_t)nd);
    if (!out) return NULL;
    for (int64_t q = 0; q < nd; q++) {
        int64_t start, len;
        if (q < s->dtail - s->dhead) {
            start = s->docs[s->dhead + q].start;
            len = s->docs[s->dhead + q].len;
        } else {
            start = s->active_start;
            len = s->tend - s->active_start;
        }
        PyObject *d = PyList_New((Py_ssize_t)len);
        if (!d) { Py_DECREF(out); return NULL; }
        for (int64_t j = 0; j < len; j++) {
            PyObject *x = PyLong_FromLong(tok_at(s, start + j));
            if (!x) { Py_DECREF(d); Py_DECREF(out); return NULL; }
            PyList_SET_ITEM(d, j, x);
        }
        PyList_SET_ITEM(out, q, d);
    }
    return out;
}

/* ---- attributes ---- */

static PyObject *get_nbytes(SuffixIndex *s, void *c) {
    uint64_t b = sizeof(SuffixIndex) + (uint64_t)s->tcap * sizeof(int32_t) + (uint64_t)s->dcap * sizeof(Doc) +
                 (uint64_t)s->ncap * sizeof(Node) + s->scap * sizeof(Slot) + 2ull * s->D * sizeof(uint32_t);
    return PyLong_FromUnsignedLongLong(b);
}
static PyObject *get_n_tokens(SuffixIndex *s, void *c) { return PyLong_FromLongLong(s->tend - s->lo); }
static PyObject *get_n_documents(SuffixIndex *s, void *c) {
    return PyLong_FromLongLong(s->dtail - s->dhead + (s->has_active ? 1 : 0));
}
static PyObject *get_n_nodes(SuffixIndex *s, void *c) { return PyLong_FromUnsignedLong(s->nlive); }
static PyObject *get_max_depth(SuffixIndex *s, void *c) { return PyLong_FromUnsignedLong(s->D); }
static PyObject *get_max_history(SuffixIndex *s, void *c) { return PyLong_FromLongLong(s->H); }
static PyObject *get_max_spec(SuffixIndex *s, void *c) { return PyLong_FromLongLong(s->max_spec); }
static PyObject *get_alpha(SuffixIndex *s, void *c) { return PyFloat_FromDouble(s->alpha); }
static PyObject *get_min_prob(SuffixIndex *s, void *c) { return PyFloat_FromDouble(s->min_prob); }

static PyGetSetDef getset[] = {
    {"nbytes", (getter)get_nbytes, NULL, "bytes allocated (arena, hash table, tokens)", NULL},
    {"n_tokens", (getter)get_n_tokens, NULL, "tokens held (history and active document)", NULL},
    {"n_documents", (getter)get_n_documents, NULL, "documents held (the active one included)", NULL},
    {"n_nodes", (getter)get_n_nodes, NULL, "trie nodes held", NULL},
    {"max_depth", (getter)get_max_depth, NULL, "D: window depth", NULL},
    {"max_history_tokens", (getter)get_max_history, NULL, "H: token cap for eviction", NULL},
    {"max_spec", (getter)get_max_spec, NULL, "cap on draft nodes", NULL},
    {"alpha", (getter)get_alpha, NULL, "draft nodes per matched token", NULL},
    {"min_prob", (getter)get_min_prob, NULL, "lowest score of a draft node", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef methods[] = {
    {"add_document", (PyCFunction)SuffixIndex_add_document, METH_O,
     "add_document(tokens): close the active document into history, start a new one"},
    {"extend", (PyCFunction)SuffixIndex_extend, METH_O,
     "extend(tokens): append to the active document (start one if none)"},
    {"end_document", (PyCFunction)SuffixIndex_end_document, METH_NOARGS,
     "end_document(): close the active document into history"},
    {"propose", (PyCFunction)SuffixIndex_propose, METH_VARARGS,
     "propose(context_tail, budget) -> (tokens, parents, scores, match_len)"},
    {"match", (PyCFunction)SuffixIndex_match, METH_O,
     "match(context_tail) -> length of the longest suffix with a continuation"},
    {"check_integrity", (PyCFunction)SuffixIndex_check_integrity, METH_NOARGS,
     "check_integrity() -> True; recount every window, RuntimeError on a mismatch"},
    {"documents", (PyCFunction)SuffixIndex_documents, METH_NOARGS,
     "documents() -> the held documents, oldest first"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SuffixIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "edgespec._native_suffix.SuffixIndex",
    .tp_basicsize = sizeof(SuffixIndex),
    .tp_dealloc = (destructor)SuffixIndex_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SuffixIndex(max_depth=32, max_history_tokens=1<<20, max_spec=32, alpha=1.0, min_prob=0.1)\n"
              "Suffix index over token streams; see edgespec/suffix_index.py.",
    .tp_methods = methods,
    .tp_getset = getset,
    .tp_new = SuffixIndex_new,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native_suffix", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__native_suffix(void) {
    if (PyType_Ready(&SuffixIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&SuffixIndexType);
    if (PyModule_AddObject(m, "SuffixIndex", (PyObject *)&SuffixIndexType) < 0) {
        Py_DECREF(&SuffixIndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
