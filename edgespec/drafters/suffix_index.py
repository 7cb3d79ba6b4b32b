"""Suffix index over token streams for the model-free ``suffix`` drafter (SuffixDecoding-style).

The index holds a list of documents (token id sequences): finished documents (earlier
requests and turns) and one active document that grows token by token. It answers one
question: given the tail of a context, which continuations are most frequent after the
longest suffix of that tail seen before, as a tree of at most ``budget`` nodes.

Specification (the C extension ``native/suffix.c`` and the pure-Python twin here,
``PySuffixIndex``, implement it exactly; ``tests/test_suffix_index.py`` holds a brute-force
reference that defines it):

* ``D = max_depth`` (>= 2). For a string ``w`` with ``len(w) + 1 <= D`` and a token ``t``,
  ``count(w -> t)`` is the number of positions ``i`` in all held documents (the active one
  included) with ``doc[i:i+len(w)] == w`` and ``doc[i+len(w)] == t``.
* Match: the longest suffix ``s`` of the last ``D - 1`` tokens of the context with
  ``1 <= len(s)`` and ``sum_t count(s -> t) > 0``. No match: empty draft, ``match_len`` 0.
* Tree: best-first from ``s`` (score 1). The candidates of a node ``w`` are the tokens ``t``
  with ``count(w -> t) > 0`` (and ``len(w) + 1 <= D``), scored
  ``score(w) * (count(w -> t) / sum_t' count(w -> t'))`` (one double division, then one
  double product). The best candidate is added until ``n`` nodes are added, none is left, or
  the best score is ``< min_prob``. Best = higher score, then smaller depth, then smaller
  token id, then smaller parent index (-1 for the root). Nodes come out in the order added,
  so ``parents[i] < i``.
* ``n = min(budget, max_spec, max(1, ceil(alpha * len(s))))``: drafts grow with the match.
* Memory: documents are evicted whole, oldest finished first, while the held tokens exceed
  ``max_history_tokens``; the active document is never evicted (a request's context is
  bounded by the target's context window). Closing an empty document drops it.
* Token ids are int32 (``OverflowError`` otherwise; ``TypeError`` for non-integers); a bad
  sequence leaves the index unchanged.

Data structure (both implementations): a path-compressed trie of the depth-bounded windows
``doc[i:i+D]`` of every position (truncated at the end of their document). The count of a
trie node is the number of windows through it, which is exactly its occurrence count. A node
is explicit when it is the root, a leaf, a branching point, or the end of some window, so the
count is constant along an edge and the number of nodes is O(tokens), not O(tokens * D).
Edge labels are not stored: node ``v`` keeps ``pos(v)``, the newest window start through it,
and its label is ``corpus[pos(v) + depth(parent) : pos(v) + depth(v)]``. Since documents are
evicted oldest first, a node whose newest window is evicted has no window left and goes with
it, so labels never dangle. The active document keeps the end node of each of its last
``D - 1`` windows; appending a token moves each one step down (split an edge, add a leaf, or
lengthen its own leaf, then merge the node it left if that became redundant): O(D) per token.
Eviction walks each window of the document from the root, decrements, prunes the zero tail
and merges its parent: O(D) per token.
"""
from __future__ import annotations

import heapq
import logging
import math
import operator
import sys
from array import array
from collections import deque
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

log = logging.getLogger(__name__)

MAX_DEPTH_LIMIT = 1024
MAX_SPEC_LIMIT = 1 << 16
MAX_HISTORY_LIMIT = 1 << 62
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_ROOT = 0



def _as_int(name: str, value, lo: int, hi: int) -> int:
    v = operator.index(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _as_float(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a real number")
    v = float(value)
    if not (lo <= v <= hi):  # also rejects NaN
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def check_params(max_depth, max_history_tokens, max_spec, alpha, min_prob):
    """Validated (D, H, max_spec, alpha, min_prob); the C extension applies the same rules."""
    return (_as_int("max_depth", max_depth, 2, MAX_DEPTH_LIMIT),
            _as_int("max_history_tokens", max_history_tokens, 0, MAX_HISTORY_LIMIT),
            _as_int("max_spec", max_spec, 0, MAX_SPEC_LIMIT),
            _as_float("alpha", alpha, 0.0, 1e9),
            _as_float("min_prob", min_prob, 0.0, 1.0))


def step_budget(budget: int, max_spec: int, alpha: float, match_len: int) -> int:
    """``min(budget, max_spec, max(1, ceil(alpha * match_len)))`` (0 without a match)."""
    if match_len <= 0:
        return 0
    x = alpha * match_len
    cap = max_spec if x >= max_spec else max(1, math.ceil(x))
    return max(0, min(budget, cap))


def _as_tokens(tokens) -> array:
    """An ``array('i')`` of the token ids; OverflowError outside int32, TypeError for non-ints."""
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu":
        if tokens.ndim != 1:
            raise TypeError("token ids must be a 1-D sequence")
        flat = tokens
        if flat.size and (int(flat.min()) < _I32_MIN or int(flat.max()) > _I32_MAX):
            raise OverflowError("token id outside int32")
        out = array("i")
        out.frombytes(flat.astype(np.intc).tobytes())
        return out
    out = array("i")
    for x in tokens:
        out.append(operator.index(x))  # array raises OverflowError outside int32
    return out


def _tail(seq, n: int) -> array:
    try:
        tail = seq[len(seq) - n:] if len(seq) > n else seq
    except TypeError:
        tail = list(seq)[-n:]
    return _as_tokens(tail)


def _integrity_fail(msg: str) -> NoReturn:
    """Raises the RuntimeError that check_integrity reports an inconsistency with."""
    raise RuntimeError(f"suffix index integrity: {msg}")


def _doc_end(docs: list[tuple[int, int]], g: int) -> int:
    """The end of the document holding global position ``g``, or -1 when none holds it."""
    for s, n in docs:
        if s <= g < s + n:
            return s + n
    return -1


class PySuffixIndex:
    """The pure-Python twin of ``edgespec._native_suffix.SuffixIndex`` (same behaviour)."""

    def __init__(self, max_depth: int = 32, max_history_tokens: int = 1 << 20,
                 max_spec: int = 32, alpha: float = 1.0, min_prob: float = 0.1) -> None:
        (self.max_depth, self.max_history_tokens, self.max_spec, self.alpha,
         self.min_prob) = check_params(max_depth, max_history_tokens, max_spec, alpha, min_prob)
        self._toks = array("i")  # held tokens; global position g is _toks[g - _base]
        self._base = 0
        self._lo = 0  # first held global position (start of the oldest held document)
        self._hist: deque[tuple[int, int]] = deque()  # finished documents (start, length)
        self._active: int | None = None  # start of the active document
        self._ends: list[int] = []  # end nodes of the active document's last D-1 windows
        # nodes (parallel lists); kids is None for a leaf, else {first token: child}
        self._par = [-1]
        self._tok = [0]
        self._cnt = [0]
        self._dep = [0]
        self._pos = [0]
        self._kids: list[dict | None] = [{}]
        self._free: list[int] = []

    # ---- bookkeeping ------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return self._base + len(self._toks) - self._lo

    @property
    def n_documents(self) -> int:
        return len(self._hist) + (self._active is not None)

    @property
    def n_nodes(self) -> int:
        return len(self._par) - len(self._free)

    @property
    def nbytes(self) -> int:
        """Approximate bytes held (Python object overheads estimated per node)."""
        lists = sum(sys.getsizeof(x) for x in (self._par, self._tok, self._cnt, self._dep,
                                                 self._pos, self._kids, self._free))
        # per live node: int objects for count/pos (~56) plus a dict for internal nodes (~1/2)
        return sys.getsizeof(self._toks) + lists + self.n_nodes * 160

    def _new(self, par: int, tok: int, cnt: int, dep: int, pos: int) -> int:
        if self._free:
            y = self._free.pop()
            self._par[y] = par
            self._tok[y] = tok
            self._cnt[y] = cnt
            self._dep[y] = dep
            self._pos[y] = pos
            self._kids[y] = None
            return y
        self._par.append(par)
        self._tok.append(tok)
        self._cnt.append(cnt)
        self._dep.append(dep)
        self._pos.append(pos)
        self._kids.append(None)
        return len(self._par) - 1

    def _release(self, x: int) -> None:
        self._kids[x] = None
        self._par[x] = -2
        self._free.append(x)

    # ---- documents ----------------------------------------------------------------------
    def add_document(self, tokens: Sequence[int]) -> None:
        """Closes the active document into history and starts a new one holding ``tokens``."""
        toks = _as_tokens(tokens)
        self._close()
        self._evict_for(len(toks))
        self._active = self._base + len(self._toks)
        self._ends = []
        self._append(toks)

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to the active document (starting one when there is none)."""
        toks = _as_tokens(tokens)
        self._evict_for(len(toks))
        if self._active is None:
            self._active = self._base + len(self._toks)
            self._ends = []
        self._append(toks)

    def end_document(self) -> None:
        """Closes the active document into history (an empty one is dropped)."""
        self._close()

    def _close(self) -> None:
        if self._active is None:
            return
        n = self._base + len(self._toks) - self._active
        if n:
            self._hist.append((self._active, n))
        self._active = None
        self._ends = []

    def _evict_for(self, extra: int) -> None:
        while self._hist and self.n_tokens + extra > self.max_history_tokens:
            start, n = self._hist.popleft()
            self._evict(start, n)
            self._lo = start + n
        dead = self._lo - self._base
        if dead and dead * 2 >= len(self._toks):
            del self._toks[:dead]
            self._base = self._lo

    # ---- insertion ----------------------------------------------------------------------
    def _append(self, toks: array) -> None:
        D = self.max_depth
        for t in toks:
            p = self._base + len(self._toks)
            self._toks.append(t)
            ends = self._ends
            n = len(ends)
            new = []
            for j in range(n):
                k = n - j  # depth of window p - k
                y = self._step(ends[j], k, t, p - k)
                if k + 1 < D:
                    new.append(y)
            new.append(self._step(_ROOT, 0, t, p))
            self._ends = new

    def _step(self, x: int, k: int, t: int, i: int) -> int:
        """Moves window ``i`` (ending at node ``x``, depth ``k``) one token ``t`` down."""
        kids = self._kids
        kx = kids[x]
        if kx is None:
            if x != _ROOT and self._cnt[x] == 1:  # a leaf of window i alone: lengthen it
                self._dep[x] += 1
                return x
            kx = kids[x] = {}
        v = kx.get(t)
        if v is None:
            y = self._new(x, t, 1, k + 1, i)
            kx[t] = y
            return y  # x now has a child of count 1 < count(x): not redundant
        if self._dep[v] == k + 1:
            self._cnt[v] += 1
            self._pos[v] = max(self._pos[v], i)
            y = v
        else:  # split the edge into v at depth k + 1
            pv = self._pos[v]
            y = self._new(x, t, self._cnt[v] + 1, k + 1, max(i, pv))
            kx[t] = y
            nt = self._toks[pv + k + 1 - self._base]
            self._par[v] = y
            self._tok[v] = nt
            kids[y] = {nt: v}
        self._maybe_merge(x)
        return y

    def _maybe_merge(self, x: int) -> None:
        """Removes ``x`` when it has one child of the same count (no window ends at x)."""
        if x == _ROOT:
            return
        kx = self._kids[x]
        if kx is None or len(kx) != 1:
            return
        (c,) = kx.values()
        if self._cnt[c] != self._cnt[x]:
            return
        p = self._par[x]
        t = self._tok[x]
        self._kids[p][t] = c
        self._par[c] = p
        self._tok[c] = t
        self._release(x)

    # ---- eviction -----------------------------------------------------------------------
    def _evict(self, start: int, n: int) -> None:
        D = self.max_depth
        toks, base = self._toks, self._base
        kids, cnt, dep = self._kids, self._cnt, self._dep
        end = start + n
        for i in range(start, end):
            L = min(D, end - i)
            u, d, path = _ROOT, 0, []
            while d < L:
                v = kids[u][toks[i + d - base]]
                path.append(v)
                d = dep[v]
                u = v
            first_zero = -1
            for q, v in enumerate(path):
                cnt[v] -= 1
                if cnt[v] == 0 and first_zero < 0:
                    first_zero = q
            if first_zero >= 0:
                f = path[first_zero]
                par = self._par[f]
                kp = kids[par]
                del kp[self._tok[f]]
                if not kp and par != _ROOT:
                    kids[par] = None
                for v in path[first_zero:]:
                    self._release(v)
                self._maybe_merge(par)
            else:
                self._maybe_merge(path[-1])

    # ---- queries ------------------------------------------------------------------------
    def _find(self, seq: array) -> tuple[int, int] | None:
        """The locus (node, depth) of ``seq``: depth(parent(node)) < depth <= depth(node)."""
        toks, base = self._toks, self._base
        u, d, n = _ROOT, 0, len(seq)
        while d < n:
            ku = self._kids[u]
            v = None if ku is None else ku.get(seq[d])
            if v is None:
                return None
            e = min(self._dep[v], n)
            off = self._pos[v] - base
            for j in range(d + 1, e):
                if toks[off + j] != seq[j]:
                    return None
            d, u = e, v
        return u, d

    def _has_continuation(self, loc: tuple[int, int]) -> bool:
        v, d = loc
        return d < self._dep[v] or self._kids[v] is not None

    def match(self, context_tail: Sequence[int]) -> int:
        """Length of the longest matching suffix (see the module docstring)."""
        return self._match(_tail(context_tail, self.max_depth - 1))[0]

    def _match(self, tail: array) -> tuple[int, tuple[int, int] | None]:
        # has-a-continuation is inherited by shorter suffixes, so binary search the length
        lo, hi, best = 0, len(tail), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            loc = self._find(tail[len(tail) - mid:])
            if loc is not None and self._has_continuation(loc):
                lo, best = mid, loc
            else:
                hi = mid - 1
        return lo, best

    def propose(self, context_tail: Sequence[int], budget: int):
        """``(tokens, parents, scores, match_len)``: the draft tree after ``context_tail``."""
        tail = _tail(context_tail, self.max_depth - 1)
        budget = operator.index(budget)
        L, loc = self._match(tail)
        n = step_budget(budget, self.max_spec, self.alpha, L)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        if n <= 0:
            return tokens, parents, scores, L
        D, min_prob = self.max_depth, self.min_prob
        toks, base = self._toks, self._base
        kids, cnt, dep, pos = self._kids, self._cnt, self._dep, self._pos
        heap: list = []

        def push_children(v: int, d: int, score: float, depth: int, idx: int) -> None:
            # children of the locus (v, d) at tree depth `depth`, node index idx
            if L + depth - 1 + 1 > D:
                return
            if d < dep[v]:
                s = score * (cnt[v] / cnt[v])
                if s >= min_prob:
                    heapq.heappush(heap, (-s, depth, toks[pos[v] + d - base], idx, v, d + 1))
                return
            kv = kids[v]
            if kv is None:
                return
            total = 0
            for c in kv.values():
                total += cnt[c]
            for t, c in kv.items():
                s = score * (cnt[c] / total)
                if s >= min_prob:
                    heapq.heappush(heap, (-s, depth, t, idx, c, d + 1))

        push_children(loc[0], loc[1], 1.0, 1, -1)
        while heap and len(tokens) < n:
            neg, depth, t, pidx, v, d = heapq.heappop(heap)
            idx = len(tokens)
            tokens.append(t)
            parents.append(pidx)
            scores.append(-neg)
            push_children(v, d, -neg, depth + 1, idx)
        return tokens, parents, scores, L

    # ---- integrity ----------------------------------------------------------------------
    def documents(self) -> list[list[int]]:
        """The held documents, oldest first (the active one last)."""
        out = [self._doc(s, n) for s, n in self._hist]
        if self._active is not None:
            out.append(self._doc(self._active, self._base + len(self._toks) - self._active))
        return out

    def _doc(self, start: int, n: int) -> list[int]:
        return list(self._toks[start - self._base:start - self._base + n])

    def check_integrity(self) -> bool:
        """Recounts every window of the held documents and checks the trie against it.

        Raises RuntimeError on the first inconsistency; returns True.
        """
        docs = self._integrity_documents()
        ends, newest_end, terminal = self._integrity_windows(docs)
        self._integrity_active_ends(terminal)
        order = self._integrity_reachable()
        self._integrity_recount(order, ends, newest_end, docs)
        return True

    def _integrity_documents(self) -> list[tuple[int, int]]:
        """Lists the held documents as (start, length), checking that they tile the held tokens."""
        end_g = self._base + len(self._toks)
        docs = list(self._hist)
        if self._active is not None:
            docs.append((self._active, end_g - self._active))
        at = self._lo
        for s, n in docs:
            if s != at or n < 0 or (n == 0 and (s, n) in self._hist):
                _integrity_fail(f"documents not contiguous at {s}")
            at = s + n
        if at != end_g or self._lo < self._base:
            _integrity_fail("documents do not cover the held tokens")
        return docs

    def _integrity_windows(self, docs: list[tuple[int, int]]
                           ) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """Walks every window; returns windows ending per node, newest start per node, end node per start."""
        ends: dict[int, int] = {}
        maxend: dict[int, int] = {}
        terminal: dict[int, int] = {}
        for s, n in docs:
            for i in range(s, s + n):
                u = self._integrity_walk(i, min(self.max_depth, s + n - i))
                ends[u] = ends.get(u, 0) + 1
                maxend[u] = max(maxend.get(u, -1), i)
                terminal[i] = u
        return ends, maxend, terminal

    def _integrity_walk(self, i: int, length: int) -> int:
        """Walks the window of ``length`` tokens at ``i`` down the trie; returns its end node."""
        base, toks, kids, par, dep, pos = (self._base, self._toks, self._kids, self._par,
                                           self._dep, self._pos)
        u, d = _ROOT, 0
        while d < length:
            ku = kids[u]
            v = None if ku is None else ku.get(toks[i + d - base])
            if v is None or par[v] != u or dep[v] > length:
                _integrity_fail(f"window {i} has no path at depth {d}")
            for j in range(d + 1, dep[v]):
                if toks[pos[v] + j - base] != toks[i + j - base]:
                    _integrity_fail(f"window {i} differs from the label of node {v}")
            d, u = dep[v], v
        return u

    def _integrity_active_ends(self, terminal: dict[int, int]) -> None:
        """Checks the kept end nodes of the active document's last D - 1 windows."""
        if self._active is not None:
            end_g = self._base + len(self._toks)
            start = max(self._active, end_g - (self.max_depth - 1))
            if [terminal[i] for i in range(start, end_g)] != self._ends:
                _integrity_fail("active window ends are stale")
        elif self._ends:
            _integrity_fail("window ends without an active document")

    def _integrity_reachable(self) -> list[int]:
        """Walks the trie from the root, checking child maps; returns every node, parents first."""
        kids, par, tokv = self._kids, self._par, self._tok
        order, stack, seen = [], [_ROOT], set()
        while stack:
            v = stack.pop()
            if v in seen:
                _integrity_fail(f"node {v} reached twice")
            seen.add(v)
            order.append(v)
            kv = kids[v]
            if kv is not None:
                if not kv and v != _ROOT:
                    _integrity_fail(f"node {v} has an empty child map")
                for t, c in kv.items():
                    if par[c] != v or tokv[c] != t:
                        _integrity_fail(f"node {c} has a wrong parent or key")
                    stack.append(c)
        if len(seen) != self.n_nodes:
            _integrity_fail(f"{self.n_nodes} nodes held, {len(seen)} reachable")
        return order

    def _integrity_recount(self, order: list[int], ends: dict[int, int], maxend: dict[int, int],
                           docs: list[tuple[int, int]]) -> None:
        """Sums window counts and newest starts up the trie, children first, and checks each node."""
        total: dict[int, int] = {}
        newest: dict[int, int] = {}
        for v in reversed(order):
            c_v = ends.get(v, 0) + total.get(v, 0)
            m_v = max(maxend.get(v, -1), newest.get(v, -1))
            if v == _ROOT:
                continue
            self._integrity_node(v, c_v, m_v, docs)
            p = self._par[v]
            total[p] = total.get(p, 0) + c_v
            newest[p] = max(newest.get(p, -1), m_v)

    def _integrity_node(self, v: int, c_v: int, m_v: int, docs: list[tuple[int, int]]) -> None:
        """Checks node ``v`` against its recounted windows ``c_v`` and newest start ``m_v``."""
        base, toks, kids, cnt, dep, pos, tokv = (self._base, self._toks, self._kids, self._cnt,
                                                 self._dep, self._pos, self._tok)
        p = self._par[v]
        if cnt[v] != c_v or c_v <= 0:
            _integrity_fail(f"node {v}: count {cnt[v]}, recounted {c_v}")
        if pos[v] != m_v:
            _integrity_fail(f"node {v}: newest window {pos[v]}, recounted {m_v}")
        if not dep[p] < dep[v] <= self.max_depth:
            _integrity_fail(f"node {v}: depth {dep[v]} under {dep[p]}")
        de = _doc_end(docs, pos[v])
        if de < 0 or pos[v] + dep[v] > de:
            _integrity_fail(f"node {v}: label outside its document")
        if toks[pos[v] + dep[p] - base] != tokv[v]:
            _integrity_fail(f"node {v}: key differs from its label")
        if p != _ROOT:
            for j in range(dep[p]):
                if toks[pos[v] + j - base] != toks[pos[p] + j - base]:
                    _integrity_fail(f"node {v}: path differs from its parent's")
        kv = kids[v]
        if kv is not None and len(kv) == 1 and cnt[next(iter(kv.values()))] == cnt[v]:
            _integrity_fail(f"node {v} is redundant")


def _load_native():
    try:
        from edgespec import _native_suffix  # type: ignore[attr-defined]
    except ImportError:
        log.debug("native suffix extension not built; using the pure-Python twin")
        return None
    return _native_suffix


_native = _load_native()
HAVE_NATIVE_SUFFIX = _native is not None
NativeSuffixIndex = _native.SuffixIndex if _native is not None else None


def SuffixIndex(max_depth: int = 32, max_history_tokens: int = 1 << 20, max_spec: int = 32,
                alpha: float = 1.0, min_prob: float = 0.1):
    """The C index when the extension was built, else the pure-Python twin."""
    cls = NativeSuffixIndex if NativeSuffixIndex is not None else PySuffixIndex
    return cls(max_depth=max_depth, max_history_tokens=max_history_tokens, max_spec=max_spec,
               alpha=alpha, min_prob=min_prob)
