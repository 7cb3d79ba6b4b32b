"""The suffix index (C extension and pure-Python twin) against a brute-force reference.

``BruteIndex`` is the specification (edgespec/suffix_index.py docstring) written as directly
as possible: it keeps the documents as lists and recounts every continuation by scanning them.
"""
from __future__ import annotations

import math
import random
from array import array

import numpy as np
import pytest

from edgespec.drafters import suffix_index as si
from edgespec.decode.tree import DraftTree
from edgespec.drafters.suffix import NAME, SuffixDrafter

IMPLS = [
    pytest.param(si.PySuffixIndex, id="python"),
    pytest.param(si.NativeSuffixIndex, id="native", marks=pytest.mark.skipif(
        not si.HAVE_NATIVE_SUFFIX,
        reason="edgespec._native_suffix not built (pip install -e . with a C compiler)")),
]


class BruteIndex:
    """The specification, by scanning all documents for every count."""

    def __init__(self, max_depth=32, max_history_tokens=1 << 20, max_spec=32, alpha=1.0,
                 min_prob=0.1):
        self.D, self.H = max_depth, max_history_tokens
        self.max_spec, self.alpha, self.min_prob = max_spec, alpha, min_prob
        self.docs: list[list[int]] = []
        self.active = False

    @property
    def n_tokens(self):
        return sum(map(len, self.docs))

    @property
    def n_documents(self):
        return len(self.docs)

    def _evict_for(self, extra):
        n_finished = len(self.docs) - self.active
        while n_finished and self.n_tokens + extra > self.H:
            self.docs.pop(0)
            n_finished -= 1

    def add_document(self, tokens):
        self.end_document()
        self._evict_for(len(tokens))
        self.docs.append([int(t) for t in tokens])
        self.active = True

    def extend(self, tokens):
        self._evict_for(len(tokens))
        if not self.active:
            self.docs.append([])
            self.active = True
        self.docs[-1].extend(int(t) for t in tokens)

    def end_document(self):
        if self.active and not self.docs[-1]:
            self.docs.pop()
        self.active = False

    def counts(self, w):
        out: dict[int, int] = {}
        if len(w) + 1 > self.D:
            return out
        n = len(w)
        for doc in self.docs:
            for i in range(len(doc) - n):
                if doc[i:i + n] == w:
                    out[doc[i + n]] = out.get(doc[i + n], 0) + 1
        return out

    def propose(self, context_tail, budget):
        tail = [int(t) for t in context_tail][-(self.D - 1):]
        L = 0
        for n in range(len(tail), 0, -1):
            if self.counts(tail[len(tail) - n:]):
                L = n
                break
        if L == 0:
            return [], [], [], 0
        n_max = min(budget, self.max_spec, max(1, math.ceil(self.alpha * L)))
        tokens, parents, scores = [], [], []
        frontier = []  # (score, depth, token, parent index, string)

        def expand(w, score, depth, idx):
            c = self.counts(w)
            total = sum(c.values())
            for t, k in c.items():
                frontier.append((score * (k / total), depth, t, idx, w + [t]))

        expand(tail[len(tail) - L:], 1.0, 1, -1)
        while frontier and len(tokens) < n_max:
            best = min(frontier, key=lambda f: (-f[0], f[1], f[2], f[3]))
            if best[0] < self.min_prob:
                break
            frontier.remove(best)
            score, depth, t, pidx, w = best
            tokens.append(t)
            parents.append(pidx)
            scores.append(score)
            expand(w, score, depth + 1, len(tokens) - 1)
        return tokens, parents, scores, L


# ---- hand cases ------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_repetition_in_the_prompt(impl):
    idx = impl(max_depth=8, max_spec=16, alpha=4.0, min_prob=0.0)
    idx.add_document([1, 2, 3, 4, 5, 9, 1, 2, 3])
    tokens, parents, scores, L = idx.propose([9, 1, 2, 3], 16)
    assert L == 3  # "1 2 3" recurs; "9 1 2 3" does not continue
    assert tokens == [4, 5, 9, 1, 2]  # depth <= D - L = 5
    assert parents == [-1, 0, 1, 2, 3]
    assert scores == [1.0] * 5
    idx.check_integrity()


@pytest.mark.parametrize("impl", IMPLS)
def test_continuation_from_an_earlier_document(impl):
    idx = impl(max_depth=6, max_spec=8, alpha=2.0, min_prob=0.0)
    idx.add_document([10, 11, 12, 13, 14])
    idx.add_document([7, 7, 10, 11])
    tokens, parents, _, L = idx.propose([7, 7, 10, 11], 8)
    assert L == 2 and tokens == [12, 13, 14] and parents == [-1, 0, 1]
    idx.extend([12])
    assert idx.propose([10, 11, 12], 8)[:2] == ([13, 14], [-1, 0])
    assert idx.n_documents == 2 and idx.n_tokens == 10


@pytest.mark.parametrize("impl", IMPLS)
def test_no_match(impl):
    idx = impl()
    assert idx.propose([1, 2, 3], 8) == ([], [], [], 0)  # empty index
    idx.add_document([1, 2, 3])
    assert idx.propose([3], 8) == ([], [], [], 0)  # seen only at the end of a document
    assert idx.propose([4], 8) == ([], [], [], 0)  # never seen
    assert idx.propose([], 8) == ([], [], [], 0)
    assert idx.propose([1], 0) == ([], [], [], 1)  # budget 0: the match is still reported


@pytest.mark.parametrize("impl", IMPLS)
def test_tie_breaking(impl):
    idx = impl(max_depth=4, max_spec=8, alpha=8.0, min_prob=0.0)
    # after 0: 5 twice, 3 twice (tie -> smaller token first); after 0 5: 1, 2; after 0 3: 1, 2
    idx.add_document([0, 5, 1, 0, 3, 2, 0, 5, 2, 0, 3, 1])
    tokens, parents, scores, L = idx.propose([0], 8)
    assert L == 1
    assert tokens[:2] == [3, 5] and parents[:2] == [-1, -1]
    # four grandchildren of score 0.25: depth ties, token ties -> earlier parent (3 before 5)
    assert tokens[2:6] == [1, 1, 2, 2] and parents[2:6] == [0, 1, 0, 1]
    assert scores[:6] == [0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    ref = BruteIndex(max_depth=4, max_spec=8, alpha=8.0, min_prob=0.0)
    ref.add_document([0, 5, 1, 0, 3, 2, 0, 5, 2, 0, 3, 1])
    assert ref.propose([0], 8) == (tokens, parents, scores, L)


@pytest.mark.parametrize("impl", IMPLS)
def test_min_prob_and_length_grow_with_the_match(impl):
    idx = impl(max_depth=16, max_spec=10, alpha=1.0, min_prob=0.3)
    idx.add_document([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 9])
    assert len(idx.propose([1], 10)[0]) == 1  # ceil(1.0 * 1)
    assert len(idx.propose([1, 2, 3], 10)[0]) == 3
    assert len(idx.propose([7, 1, 2, 3, 4, 5, 6], 4)[0]) == 4  # budget argument caps
    # after "6 7": 8 and 9 at 0.5 each; min_prob 0.6 keeps none
    strict = impl(max_depth=16, max_spec=10, alpha=1.0, min_prob=0.6)
    strict.add_document([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 9])
    assert strict.propose([6, 7], 10) == ([], [], [], 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_tree_shape(impl):
    rng = random.Random(5)
    D = 7
    idx = impl(max_depth=D, max_spec=20, alpha=20.0, min_prob=0.0)
    for _ in range(4):
        idx.add_document([rng.randrange(3) for _ in range(200)])
    for _ in range(50):
        ctx = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        budget = rng.randrange(0, 25)
        tokens, parents, scores, L = idx.propose(ctx, budget)
        assert len(tokens) <= min(budget, 20)
        tree = DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64))
        assert all(p < i for i, p in enumerate(parents))
        if tokens:
            assert 1 <= L <= D - 1
            assert tree.depth().max() <= D - L
            assert all(scores[i] <= (1.0 if p < 0 else scores[p]) for i, p in enumerate(parents))


@pytest.mark.parametrize("impl", IMPLS)
def test_eviction_bounds_memory_and_forgets_old_documents(impl):
    idx = impl(max_depth=8, max_history_tokens=1000, min_prob=0.0)
    idx.add_document([100, 101, 102, 103])
    assert idx.propose([100], 4)[0] == [101]
    rng = random.Random(1)
    sizes = []
    for _ in range(60):
        idx.add_document([rng.randrange(50) for _ in range(300)])
        sizes.append(idx.nbytes)
        assert idx.n_tokens <= 1000
    assert idx.n_documents == 3
    assert idx.propose([100], 4) == ([], [], [], 0)  # the first document is gone
    assert max(sizes[30:]) <= 1.5 * max(sizes[:10])  # bounded, not growing with the stream
    idx.check_integrity()
    # the active document is never evicted, even past the cap
    idx.add_document(list(range(2000)))
    assert idx.n_documents == 1 and idx.n_tokens == 2000
    idx.check_integrity()


@pytest.mark.parametrize("impl", IMPLS)
def test_documents_lifecycle(impl):
    idx = impl(max_depth=4)
    assert idx.n_documents == 0 and idx.n_tokens == 0
    idx.extend([1, 2])  # starts a document
    idx.end_document()
    idx.end_document()
    idx.add_document([])
    idx.add_document([])  # empty documents are dropped when closed
    assert idx.n_documents == 2 and idx.n_tokens == 2
    idx.extend([1, 2])
    assert idx.propose([1], 4)[0] == [2]
    idx.check_integrity()


@pytest.mark.parametrize("impl", IMPLS)
def test_hostile_input(impl):
    idx = impl(max_depth=5)
    big, small = 2**31 - 1, -2**31
    idx.add_document([big, small, -1, 0, big, small, -1])
    assert idx.propose([big], 4)[0][:1] == [small]
    for bad in ([2**31], [-2**31 - 1], [1.5], ["a"], [None]):
        with pytest.raises((OverflowError, TypeError)):
            idx.extend(bad)
        with pytest.raises((OverflowError, TypeError)):
            idx.add_document([1] + bad)
        with pytest.raises((OverflowError, TypeError)):
            idx.propose(bad, 4)
    with pytest.raises(TypeError):
        idx.extend(5)
    assert idx.n_tokens == 7 and idx.n_documents == 1  # failed calls changed nothing
    idx.extend(np.array([big, 3], np.int64))
    idx.extend(array("i", [4, 5]))
    idx.extend(np.array([6], np.int32))
    assert idx.propose(np.array([small, -1], np.int64), 4)[0][:1] == [0]
    with pytest.raises(OverflowError):
        idx.extend(np.array([2**40], np.int64))
    with pytest.raises(OverflowError):
        idx.propose(np.array([2**40], np.int64), 4)
    assert idx.propose([small], -5) == ([], [], [], 1)
    assert idx.propose([small], 2**70)[3] == 1
    for kw in ({"max_depth": 1}, {"max_depth": 5000}, {"max_history_tokens": -1},
               {"max_spec": -1}, {"alpha": -1.0}, {"alpha": float("nan")},
               {"min_prob": 1.5}, {"max_history_tokens": 2**80}):
        with pytest.raises(ValueError):
            impl(**kw)
    idx.check_integrity()


# ---- against the reference -------------------------------------------------------------

def _random_session(rng: random.Random, impls, n_ops: int):
    """Runs the same random operations on every index; yields after each one."""
    V = rng.randrange(2, 7)
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.25:
            toks = [rng.randrange(V) for _ in range(rng.randrange(0, 40))]
            for x in impls:
                x.add_document(toks)
        elif op < 0.75:
            toks = [rng.randrange(V) for _ in range(rng.randrange(0, 6))]
            for x in impls:
                x.extend(toks)
        elif op < 0.8:
            for x in impls:
                x.end_document()
        else:
            ctx = [rng.randrange(V) for _ in range(rng.randrange(0, 10))]
            if rng.random() < 0.5 and impls[0].n_tokens:
                # a real tail of the last document makes long matches likely
                ctx = (impls[-1].docs[-1] if impls[-1].docs else []) or ctx
            budget = rng.randrange(0, 30)
            yield ctx, budget


@pytest.mark.parametrize("impl", IMPLS)
def test_property_against_brute_force(impl):
    n_cases = 0
    for seed in range(300):
        rng = random.Random(seed)
        params = {"max_depth": rng.randrange(2, 9), "max_history_tokens": rng.randrange(0, 150),
                      "max_spec": rng.randrange(0, 25), "alpha": rng.choice([0.5, 1.0, 1.5, 3.0, 8.0]),
                      "min_prob": rng.choice([0.0, 0.0, 0.05, 0.1, 0.3])}
        impls = [impl(**params), BruteIndex(**params)]
        for ctx, budget in _random_session(rng, impls, 60):
            got = impls[0].propose(ctx, budget)
            want = impls[1].propose(ctx, budget)
            assert got == want, (seed, params, ctx, budget)
            assert impls[0].n_tokens == impls[1].n_tokens
            assert impls[0].n_documents == impls[1].n_documents
            n_cases += 1
        impls[0].check_integrity()
    assert n_cases > 3000


@pytest.mark.skipif(not si.HAVE_NATIVE_SUFFIX, reason="edgespec._native_suffix not built")
def test_native_matches_twin_and_reference_step_by_step():
    for seed in range(100):
        rng = random.Random(1000 + seed)
        params = {"max_depth": rng.randrange(2, 10), "max_history_tokens": rng.randrange(0, 200),
                      "max_spec": rng.randrange(0, 25), "alpha": rng.choice([1.0, 2.0, 16.0]),
                      "min_prob": rng.choice([0.0, 0.1])}
        impls = [si.NativeSuffixIndex(**params), si.PySuffixIndex(**params), BruteIndex(**params)]
        for ctx, budget in _random_session(rng, impls, 80):
            a, b, c = (x.propose(ctx, budget) for x in impls)
            assert a == b == c, (seed, params, ctx, budget)
            assert impls[0].n_tokens == impls[1].n_tokens == impls[2].n_tokens
        impls[0].check_integrity()
        impls[1].check_integrity()


@pytest.mark.skipif(not si.HAVE_NATIVE_SUFFIX, reason="edgespec._native_suffix not built")
def test_native_matches_twin_on_a_long_stream():
    rng = random.Random(7)
    params = {"max_depth": 24, "max_history_tokens": 12_000, "max_spec": 48, "alpha": 2.0,
                  "min_prob": 0.05}
    nat, py = si.NativeSuffixIndex(**params), si.PySuffixIndex(**params)
    # a Zipf-ish vocabulary with copied spans, like code being edited
    stream: list[int] = []
    n_checked = 0
    while len(stream) < 20_000:
        if stream and rng.random() < 0.3:
            a = rng.randrange(len(stream))
            chunk = stream[a:a + rng.randrange(5, 80)]
        else:
            chunk = [min(int(rng.paretovariate(1.1)), 3000) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.02:
            nat.add_document(chunk)
            py.add_document(chunk)
        else:
            nat.extend(chunk)
            py.extend(chunk)
        stream.extend(chunk)
        ctx = stream[-23:]
        assert nat.propose(ctx, 64) == py.propose(ctx, 64)
        n_checked += 1
    assert nat.n_tokens == py.n_tokens <= 12_000 + 20_000
    assert n_checked > 500
    nat.check_integrity()
    py.check_integrity()


@pytest.mark.parametrize("impl", IMPLS)
def test_integrity_after_random_operations(impl):
    for seed in range(20):
        rng = random.Random(seed + 50)
        idx = impl(max_depth=rng.randrange(2, 12), max_history_tokens=rng.randrange(50, 400))
        V = rng.randrange(2, 20)
        for _ in range(200):
            op = rng.random()
            if op < 0.1:
                idx.add_document([rng.randrange(V) for _ in range(rng.randrange(0, 60))])
            elif op < 0.15:
                idx.end_document()
            else:
                idx.extend([rng.randrange(V) for _ in range(rng.randrange(0, 8))])
            if rng.random() < 0.1:
                assert idx.check_integrity()
        assert idx.check_integrity()


# ---- the drafter -------------------------------------------------------------------------

def test_factory_prefers_native():
    idx = si.SuffixIndex(max_depth=8)
    if si.HAVE_NATIVE_SUFFIX:
        assert isinstance(idx, si.NativeSuffixIndex)
    else:
        assert isinstance(idx, si.PySuffixIndex)


def test_suffix_drafter_lifecycle():
    d = SuffixDrafter(max_depth=16, max_spec=8, alpha=2.0, min_prob=0.0)
    assert NAME == d.name == "suffix"
    prompt = [5, 6, 7, 8, 9, 5, 6]
    d.begin(prompt)
    tree = d.propose(prompt, 8)
    assert tree.source == "suffix" and list(tree.tokens) == [7, 8, 9, 5]
    assert tree.match_len == 2 and len(tree.scores) == 4
    d.observe([7, 8])
    tree = d.propose(prompt + [7, 8], 3)
    assert list(tree.tokens) == [9, 5, 6] and list(tree.parents) == [-1, 0, 1]
    d.end()
    d.begin([1, 2, 9])  # the previous request is history now
    assert list(d.propose([1, 2, 9], 2).tokens) == [5, 6]
    assert d.nbytes > 0
    assert len(d.propose([1000], 4)) == 0
