"""Proofs by test for edgespec.spec.acceptance.

The stochastic rule is checked three ways:

1. An exact enumerator (``rrs_outcomes`` and friends below) mirrors the algorithm's branching
   with probabilities instead of random draws. Marginalized over the drafter's own sampling,
   its distribution of emitted tokens equals the target's to 1e-12 for many random targets,
   drafts and tree shapes (``test_exact_*``).
2. The real ``accept_stochastic`` agrees with the enumerator on fixed drafts, and end to end
   (drafts built with ``sample_without_replacement``) its first tokens and (first, second)
   pairs match the target, by chi-square tests with fixed seeds (deterministic, no flakes).
3. The same chi-square check rejects deliberately wrong rules (negative controls), so it has
   the power to catch a bug.

Tiny "language models" stand in for the target and the drafter: a random next-token
distribution per prefix, so each tree row is the target's conditional distribution there.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from edgespec.spec.acceptance import (
    Acceptance,
    accept_greedy,
    accept_stochastic,
    sample_without_replacement,
)
from edgespec.decode.tree import DraftTree
from edgespec.decode.sampling import sample_from

ALPHA = 1e-3  # chi-square threshold; every sample is seeded, so each verdict is fixed
EXACT = 1e-12
STYLES = ("flat", "peaky", "holes", "onehot")


# --------------------------------------------------------------------------- toy models

def random_dist(V: int, rng: np.random.Generator, style: str) -> np.ndarray:
    """A [V] distribution: flat, peaky, with zeros ("holes"), or one-hot."""
    if style == "onehot":
        p = np.zeros(V)
        p[rng.integers(V)] = 1.0
    elif style == "peaky":
        p = rng.dirichlet(np.full(V, 0.2))
    else:
        p = rng.dirichlet(np.ones(V))
        if style == "holes":
            p[rng.random(V) < 0.5] = 0.0
            if p.sum() == 0:
                p[rng.integers(V)] = 1.0
    return p / p.sum()


class ToyLM:
    """prefix (tuple of token ids) -> [V] next-token distribution, random but fixed once asked."""

    def __init__(self, V: int, seed: int, styles=STYLES, fixed: dict | None = None):
        self.V = V
        self._rng = np.random.default_rng(seed)
        self._styles = styles
        self._cache = {tuple(k): np.asarray(v, float) for k, v in (fixed or {}).items()}

    def __call__(self, prefix) -> np.ndarray:
        prefix = tuple(int(t) for t in prefix)
        if prefix not in self._cache:
            style = self._styles[self._rng.integers(len(self._styles))]
            self._cache[prefix] = random_dist(self.V, self._rng, style)
        return self._cache[prefix]


class ToyDrafter:
    """Per (prefix, k): a sparse draft distribution from ``qlm`` or, with probability
    ``det_frac``, k fixed tokens (a deterministic group; duplicates allowed)."""

    def __init__(self, qlm: ToyLM, seed: int, det_frac: float = 0.0, keep_zeros: bool = False):
        self.qlm, self.det_frac, self.keep_zeros = qlm, det_frac, keep_zeros
        self._rng = np.random.default_rng(seed)
        self._cache: dict = {}

    def group(self, prefix, k: int):
        key = (tuple(int(t) for t in prefix), k)
        if key not in self._cache:
            if self._rng.random() < self.det_frac:
                self._cache[key] = ("det", [int(t) for t in self._rng.integers(self.qlm.V, size=k)])
            else:
                q = self.qlm(key[0])
                ids = np.arange(len(q)) if self.keep_zeros else np.flatnonzero(q)
                self._cache[key] = ("q", ids, q[ids])
        return self._cache[key]


def build_draft(shape, drafter: ToyDrafter, rng) -> DraftTree:
    """Draw a draft tree: ``shape`` is a list of child shapes (``[]`` = leaf); the k-th drawn
    sibling gets ``shape[k]``. Siblings come from ``sample_without_replacement``."""
    tokens, parents, q_ids, q_probs = [], [], [], []

    def grow(node, prefix, shape):
        if not shape:
            return
        group = drafter.group(prefix, len(shape))
        if group[0] == "q":
            drawn = sample_without_replacement(group[1], group[2], len(shape), rng)
            qi, qp = group[1], group[2]
        else:
            drawn, qi, qp = group[1], None, None
        first = len(tokens)
        for t in drawn:
            tokens.append(t)
            parents.append(node)
            q_ids.append(qi)
            q_probs.append(qp)
        for j, (t, sub) in enumerate(zip(drawn, shape)):
            grow(first + j, prefix + (t,), sub)

    grow(-1, (), shape)
    return make_tree(tokens, parents, q_ids, q_probs)


def make_tree(tokens, parents, q_ids=None, q_probs=None) -> DraftTree:
    stochastic = q_ids is not None and any(q is not None for q in q_ids)
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64),
                     tuple(q_ids) if stochastic else None, tuple(q_probs) if stochastic else None)


def prefix_of(draft: DraftTree, node: int) -> tuple:
    return tuple(int(draft.tokens[i]) for i in draft.path_to(node))


def row_fn(draft: DraftTree, lm: ToyLM):
    """Lazy target rows: row r is the target after node r-1 (row 0 = root)."""
    return lambda r: lm(prefix_of(draft, r - 1))


def rows_array(draft: DraftTree, lm: ToyLM) -> np.ndarray:
    return np.stack([lm(prefix_of(draft, r - 1)) for r in range(len(draft) + 1)])  # [n+1, V]


# --------------------------------------------------------------------------- exact enumerator

def rrs_outcomes(p: np.ndarray, q: np.ndarray, draws) -> list:
    """Exact outcomes of recursive rejection sampling without replacement at one row.

    Args:
        p: [V] target row. q: [V] dense base draft distribution of the sibling group.
        draws: (k, q_k) -> None when there is no k-th sibling, else [(token, prob, payload)]:
            the k-th sibling's possible tokens (a fixed draft: one token with prob 1).
    Returns:
        [(prob, "accept" | "bonus", token, payload)].
    """
    out = []
    z_row = p.sum()

    def stage(k, r, z, removed, w):  # r: unnormalized residual of mass z
        qk = q.copy()
        qk[list(removed)] = 0.0
        qk = qk / qk.sum() if qk.sum() > 0 else qk
        options = draws(k, qk)
        if options is None:
            out.extend((w * r[x] / z, "bonus", int(x), None) for x in np.flatnonzero(r))
            return
        for x, px, payload in options:
            if qk[x] <= 0:  # not drawable from q_k: skipped
                stage(k + 1, r, z, removed, w * px)
                continue
            a = min(1.0, r[x] / (z * qk[x]))
            if a > 0:
                out.append((w * px * a, "accept", int(x), payload))
            if a < 1:
                res = np.maximum(r - z * qk, 0.0)
                if res.sum() <= 1e-12 * z_row:
                    out.extend((w * px * (1 - a) * p[y] / z_row, "bonus", int(y), None)
                               for y in np.flatnonzero(p))
                else:
                    stage(k + 1, res, res.sum(), removed + (x,), w * px * (1 - a))

    stage(0, p, z_row, (), 1.0)
    return out


def dense(V, ids, probs) -> np.ndarray:
    q = np.zeros(V)
    q[np.asarray(ids)] = probs
    return q


def exact_outcomes(draft: DraftTree, rows: np.ndarray) -> dict:
    """Exact distribution of accept_stochastic on a FIXED draft: {(path, bonus): prob}."""
    V = rows.shape[1]
    kids = {n: draft.children(n) for n in range(-1, len(draft))}
    out = defaultdict(float)

    def walk(node, path, w):
        p, ch = rows[node + 1], kids[node]
        if not ch:
            for x in np.flatnonzero(p):
                out[path, int(x)] += w * p[x] / p.sum()
        elif draft.stochastic and draft.q_ids[ch[0]] is not None:
            q = dense(V, draft.q_ids[ch[0]], draft.q_probs[ch[0]])
            draws = lambda k, qk: None if k >= len(ch) else [(int(draft.tokens[ch[k]]), 1.0, ch[k])]
            for pr, kind, x, child in rrs_outcomes(p, q / q.sum(), draws):
                if kind == "bonus":
                    out[path, x] += w * pr
                else:
                    walk(child, path + (child,), w * pr)
        else:
            for x in np.flatnonzero(p):
                child = next((c for c in ch if draft.tokens[c] == x), None)
                if child is None:
                    out[path, int(x)] += w * p[x] / p.sum()
                else:
                    walk(child, path + (child,), w * p[x] / p.sum())

    walk(-1, (), 1.0)
    return dict(out)


def as_emitted(draft: DraftTree, outcomes: dict) -> dict:
    """{(path, bonus): prob} -> {emitted token tuple: prob}."""
    out = defaultdict(float)
    for (path, bonus), pr in outcomes.items():
        out[tuple(int(draft.tokens[i]) for i in path) + (bonus,)] += pr
    return dict(out)


def exact_marginal(shape, lm: ToyLM, drafter: ToyDrafter) -> dict:
    """Exact distribution of emitted tokens, over the drafter's sampling AND the acceptance.

    Siblings are drawn lazily, one stage at a time: the k-th draw depends only on earlier
    draws, and the decision about the k-th sibling does not depend on later ones, so this
    has the same joint law as drawing the whole tree first (checked against explicit
    enumeration in ``test_exact_marginal_equals_sum_over_enumerated_drafts``).
    """
    out = defaultdict(float)

    def walk(prefix, shape, w):
        p = lm(prefix)
        if not shape:
            for x in np.flatnonzero(p):
                out[prefix + (int(x),)] += w * p[x]
            return
        group = drafter.group(prefix, len(shape))
        if group[0] == "det":
            for x in np.flatnonzero(p):
                j = next((j for j, t in enumerate(group[1]) if t == x), None)
                if j is None:
                    out[prefix + (int(x),)] += w * p[x]
                else:
                    walk(prefix + (int(x),), shape[j], w * p[x])
            return
        q = dense(lm.V, group[1], group[2])

        def draws(k, qk):
            if k >= len(shape) or qk.sum() <= 0:
                return None
            return [(int(x), qk[x], k) for x in np.flatnonzero(qk)]

        for pr, kind, x, k in rrs_outcomes(p, q / q.sum(), draws):
            if kind == "bonus":
                out[prefix + (x,)] += w * pr
            else:
                walk(prefix + (x,), shape[k], w * pr)

    walk((), shape, 1.0)
    return dict(out)


def all_drafts(shape, drafter: ToyDrafter) -> list:
    """Every draft ``build_draft`` can return, with its probability: [(prob, DraftTree)]."""
    def ordered_draws(ids, probs, k):
        res = []

        def go(seq, w, weights):
            if len(seq) == k or weights.sum() <= 0:
                res.append((w, seq))
                return
            for pos in np.flatnonzero(weights):
                rest = weights.copy()
                rest[pos] = 0.0
                go(seq + [int(ids[pos])], w * weights[pos] / weights.sum(), rest)

        go([], 1.0, np.asarray(probs, float))
        return res

    out = []

    def expand(nodes, todo, prob):
        if not todo:
            out.append((prob, make_tree(*zip(*nodes)) if nodes else make_tree([], [])))
            return
        (node, prefix, sh), rest = todo[0], todo[1:]
        if not sh:
            expand(nodes, rest, prob)
            return
        group = drafter.group(prefix, len(sh))
        options = ([(1.0, group[1])] if group[0] == "det"
                   else ordered_draws(group[1], group[2], len(sh)))
        qi, qp = (None, None) if group[0] == "det" else (group[1], group[2])
        for pr, drawn in options:
            first = len(nodes)
            new = nodes + [(t, node, qi, qp) for t in drawn]
            kids = [(first + j, prefix + (t,), s) for j, (t, s) in enumerate(zip(drawn, sh))]
            expand(new, kids + rest, prob * pr)

    expand([], [(-1, (), shape)], 1.0)
    return out


def extend(seq_dist: dict, lm: ToyLM, L: int) -> dict:
    """Distribution of the first L output tokens: sequences shorter than L continue with the
    target itself (the next steps, exact by induction), longer ones are truncated."""
    out = defaultdict(float)

    def go(seq, w):
        if len(seq) >= L:
            out[seq[:L]] += w
            return
        p = lm(seq)
        for x in np.flatnonzero(p):
            go(seq + (int(x),), w * p[x])

    for seq, w in seq_dist.items():
        go(seq, w)
    return dict(out)


def assert_same_dist(got: dict, want: dict, tol=EXACT):
    keys = set(got) | set(want)
    worst = max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in keys)
    assert worst <= tol, f"max |diff| {worst:.3g}"


def assert_matches_target(emitted: dict, lm: ToyLM, max_len: int):
    assert abs(sum(emitted.values()) - 1.0) <= EXACT
    for L in range(1, max_len + 1):
        assert_same_dist(extend(emitted, lm, L), extend({(): 1.0}, lm, L))


# --------------------------------------------------------------------------- chi-square

def chi2_pvalue(observed: Counter, expected: dict) -> float:
    """Chi-square goodness of fit; categories expected < 5 times are pooled. An outcome of
    probability 0 that was observed fails outright (p-value 0)."""
    n = sum(observed.values())
    if any(expected.get(k, 0.0) <= 0 for k in observed):
        return 0.0
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in sorted(expected, key=lambda k: -expected[k]):  # largest first
        if expected[k] * n >= 5:
            obs.append(observed.get(k, 0))
            exp.append(expected[k] * n)
        else:
            pool_o += observed.get(k, 0)
            pool_e += expected[k] * n
    if pool_e >= 5 or not obs:
        obs.append(pool_o)
        exp.append(pool_e)
    elif pool_e > 0:  # too small on its own: fold into the smallest category
        obs[-1] += pool_o
        exp[-1] += pool_e
    if len(obs) < 2:
        return 1.0
    exp = np.array(exp) * (n / np.sum(exp))  # exact totals for scipy
    return float(chisquare(obs, exp).pvalue)


def end_to_end_counts(accept, lm, drafter, shape, n, seed):
    """Sample n steps (fresh draft each time); count first tokens and (first, second) pairs."""
    rng = np.random.default_rng(seed)
    firsts, pairs = Counter(), Counter()
    for _ in range(n):
        draft = build_draft(shape, drafter, rng)
        out = accept(draft, row_fn(draft, lm), rng).emitted_tokens(draft)
        if len(out) == 1:  # the second token comes from the next step: a target sample
            out.append(sample_from(lm(tuple(out)), rng))
        firsts[out[0]] += 1
        pairs[tuple(out[:2])] += 1
    return firsts, pairs


def target_dists(lm):
    return ({k[0]: v for k, v in extend({(): 1.0}, lm, 1).items()},
            extend({(): 1.0}, lm, 2))


def reference_accept(draft, target_p, rng, bug=None):
    """A dense, literal transcription of the rule for tiny V, with deliberate bugs for the
    negative controls: "accept_drawn" accepts every drawn child (emits the drafter's samples);
    "base_q" uses the sibling group's base q for every sibling, the rule for drafts drawn WITH
    replacement (wrong here: later siblings get over-accepted)."""
    path, node = [], -1
    while True:
        p, ch = target_p(node + 1), draft.children(node)
        if not ch:
            return Acceptance(tuple(path), sample_from(p, rng))
        if bug == "accept_drawn":
            path.append(ch[0])
            node = ch[0]
            continue
        q = dense(len(p), draft.q_ids[ch[0]], draft.q_probs[ch[0]])
        r, nxt = p.copy(), None
        for j, c in enumerate(ch):
            x = int(draft.tokens[c])
            qk = q.copy()
            if bug != "base_q":  # q_k: earlier siblings removed
                qk[[int(draft.tokens[d]) for d in ch[:j]]] = 0.0
            qk /= qk.sum()
            if rng.random() < min(1.0, r[x] / qk[x]):
                nxt = c
                break
            r = np.maximum(r - qk, 0.0)
            r /= r.sum()
        if nxt is None:
            return Acceptance(tuple(path), sample_from(r, rng))
        path.append(nxt)
        node = nxt


# --------------------------------------------------------------------------- greedy

def test_greedy_chain_all_accepted():
    draft = DraftTree.chain([5, 6, 7])
    acc = accept_greedy(draft, np.array([5, 6, 7, 8]))
    assert acc == Acceptance((0, 1, 2), 8)
    assert acc.emitted_tokens(draft) == [5, 6, 7, 8]
    assert acc.accepted_tokens(draft) == [5, 6, 7] and acc.n_accepted == 3


def test_greedy_early_mismatch():
    assert accept_greedy(DraftTree.chain([5, 6, 7]), np.array([5, 9, 7, 8])) == Acceptance((0,), 9)


def test_greedy_first_node_mismatch():
    draft = DraftTree.chain([5, 6, 7])
    acc = accept_greedy(draft, np.array([4, 6, 7, 8]))
    assert acc == Acceptance((), 4) and acc.emitted_tokens(draft) == [4]


def test_greedy_empty_draft():
    assert accept_greedy(DraftTree.empty(), np.array([3])) == Acceptance((), 3)


def test_greedy_second_branch():
    # root -> {0: 1, 1: 2}; 1 -> {2: 3}
    draft = make_tree([1, 2, 3], [-1, -1, 1])
    assert accept_greedy(draft, np.array([2, 0, 3, 4])) == Acceptance((1, 2), 4)


def test_greedy_deeper_branch_choice():
    # root -> {0: 1, 1: 2}; 0 -> {2: 5, 3: 6}; 1 -> {4: 5}; 3 -> {5: 9}
    draft = make_tree([1, 2, 5, 6, 5, 9], [-1, -1, 0, 0, 1, 3])
    argmax = np.array([1, 6, 5, 0, 9, 0, 8])  # row 0 = root, row i+1 = after node i
    assert accept_greedy(draft, argmax) == Acceptance((0, 3, 5), 8)
    argmax[0] = 2  # now the other subtree: 2 then 5 (row 2), then row 5 = 0
    assert accept_greedy(draft, argmax) == Acceptance((1, 4), 0)


def test_greedy_duplicate_siblings_first_wins():
    draft = make_tree([3, 3, 4], [-1, -1, 1])
    assert accept_greedy(draft, np.array([3, 9, 4, 0])) == Acceptance((0,), 9)


# --------------------------------------------------------------------------- exact proofs

SHAPES = {
    "leaf-only": [],
    "single": [[]],
    "chain2": [[[]]],
    "chain3": [[[[]]]],
    "siblings2": [[], []],
    "siblings3": [[], [], []],
    "tree": [[[], []], [[]]],
    "tree3": [[[]], [[], []], []],
}

DRAFTERS = {  # how q relates to the target p
    "independent": lambda V, s, lm: ToyDrafter(ToyLM(V, 1000 + s), s),
    "q_equals_p": lambda V, s, lm: ToyDrafter(lm, s),
    "onehot_q": lambda V, s, lm: ToyDrafter(ToyLM(V, 1000 + s, styles=("onehot",)), s),
    "holes_q_zeros_kept": lambda V, s, lm: ToyDrafter(ToyLM(V, 1000 + s, ("holes",)), s,
                                                     keep_zeros=True),
    "mixed": lambda V, s, lm: ToyDrafter(ToyLM(V, 1000 + s), s, det_frac=0.5),
    "deterministic": lambda V, s, lm: ToyDrafter(ToyLM(V, 1000 + s), s, det_frac=1.0),
}


def depth(shape) -> int:
    return 0 if not shape else 1 + max(depth(s) for s in shape)


@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_exact_marginal_equals_target(shape_name, kind):
    """Over the draft's sampling and the acceptance, emitted tokens are target samples: the
    first 1..depth+1 output tokens have exactly the target's joint distribution."""
    shape = SHAPES[shape_name]
    for seed in range(12):
        V = 3 + seed % 2
        lm = ToyLM(V, seed)
        emitted = exact_marginal(shape, lm, DRAFTERS[kind](V, seed, lm))
        assert_matches_target(emitted, lm, min(depth(shape) + 1, 3))


def test_exact_wild_q():
    """q concentrated where p has no mass, and vice versa."""
    p = np.array([0.0, 0.0, 0.5, 0.5])
    for q_root in ([1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.98, 0.01, 0.01, 0.0], [0, 0, 1e-9, 1 - 1e-9]):
        lm = ToyLM(4, 7, fixed={(): p})
        qlm = ToyLM(4, 8, fixed={(): q_root})
        for keep_zeros in (False, True):
            for shape in (SHAPES["siblings3"], SHAPES["tree"], SHAPES["chain2"]):
                emitted = exact_marginal(shape, lm, ToyDrafter(qlm, 0, keep_zeros=keep_zeros))
                assert_matches_target(emitted, lm, 2)


@pytest.mark.parametrize("shape_name", ["chain2", "siblings3", "tree", "tree3"])
def test_exact_marginal_equals_sum_over_enumerated_drafts(shape_name):
    """The lazy enumerator equals: sum over every drawable draft tree of P(tree) x the exact
    outcome distribution on that fixed tree (the enumerator the real function is checked
    against by Monte Carlo)."""
    for seed, det_frac in ((0, 0.0), (1, 0.0), (2, 0.5)):
        V = 3
        lm = ToyLM(V, seed)
        drafter = ToyDrafter(ToyLM(V, 50 + seed, ("flat", "peaky")), seed, det_frac)
        total = defaultdict(float)
        drafts = all_drafts(SHAPES[shape_name], drafter)
        assert abs(sum(pr for pr, _ in drafts) - 1.0) <= EXACT
        for pr, draft in drafts:
            for seq, w in as_emitted(draft, exact_outcomes(draft, rows_array(draft, lm))).items():
                total[seq] += pr * w
        assert_same_dist(dict(total), exact_marginal(SHAPES[shape_name], lm, drafter))


def test_exact_deterministic_trees_any_tree():
    """Deterministic drafts are exact for EVERY fixed tree, even with duplicate siblings and
    tokens the target never picks."""
    rng = np.random.default_rng(0)
    for seed in range(60):
        V = 3 + seed % 2
        n = int(rng.integers(1, 7))
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        draft = make_tree(rng.integers(V, size=n), parents)
        lm = ToyLM(V, seed)
        emitted = as_emitted(draft, exact_outcomes(draft, rows_array(draft, lm)))
        assert_matches_target(emitted, lm, 3)


# --------------------------------------------------------------------------- Monte Carlo

def fixed_trees():
    """Hand-built fixed drafts with their target rows: [(name, draft, rows)]."""
    V = 6
    lm = ToyLM(V, 3, fixed={(): [0.05, 0.4, 0.3, 0.0, 0.15, 0.1]})
    q0 = np.array([0.6, 0.1, 0.05, 0.2, 0.05, 0.0])
    ids, probs = np.arange(V), q0
    q1 = (np.array([1, 2]), np.array([0.5, 0.5]))
    out = []
    # chain: 0 (q wildly off) -> 1
    out.append(("chain", make_tree([0, 1], [-1, 0], [ids, q1[0]], [probs, q1[1]])))
    # three siblings (0, 3, 1) then children under the 2nd and 3rd
    out.append(("siblings", make_tree([0, 3, 1, 2, 4], [-1, -1, -1, 1, 2],
                                      [ids] * 3 + [q1[0], np.array([4, 5])],
                                      [probs] * 3 + [q1[1], np.array([0.9, 0.1])])))
    # malformed: duplicate sibling, and a child outside q (both must be skipped)
    out.append(("duplicates", make_tree([3, 3, 5], [-1, -1, -1], [ids] * 3, [probs] * 3)))
    # deterministic tree with a duplicate
    out.append(("deterministic", make_tree([1, 2, 1, 3, 0], [-1, -1, -1, 0, 0])))
    return [pytest.param(name, draft, rows_array(draft, lm), id=name) for name, draft in out]


@pytest.mark.parametrize("name,draft,rows", fixed_trees())
def test_real_function_matches_enumerator(name, draft, rows):
    """The real function's (path, bonus) frequencies match the exact enumerator's."""
    rng = np.random.default_rng(11)
    counts = Counter()
    for _ in range(20000):
        acc = accept_stochastic(draft, rows, rng)
        counts[acc.path, acc.bonus] += 1
    assert chi2_pvalue(counts, exact_outcomes(draft, rows)) > ALPHA
    if name == "duplicates":
        assert all(path in ((), (0,)) for path, _ in counts)


E2E = {
    "chain3": (6, [[[[]]]], 0.0),
    "tree": (6, [[[], []], [[]], []], 0.0),
    "deterministic": (6, [[[], []], [[]], []], 1.0),
    "mixed": (5, [[[], []], [[]]], 0.5),
}


@pytest.mark.parametrize("config", E2E)
def test_end_to_end_chi_square(config):
    V, shape, det_frac = E2E[config]
    lm = ToyLM(V, 21, styles=("flat", "peaky", "holes"))
    drafter = ToyDrafter(ToyLM(V, 22, styles=("flat", "peaky", "holes")), 23, det_frac)
    firsts, pairs = end_to_end_counts(accept_stochastic, lm, drafter, shape, 20000, seed=5)
    want1, want2 = target_dists(lm)
    assert chi2_pvalue(firsts, want1) > ALPHA
    assert chi2_pvalue(pairs, want2) > ALPHA


NEGATIVE_ROOT_P = [0.1, 0.45, 0.25, 0.15, 0.05]
NEGATIVE_ROOT_Q = [0.55, 0.25, 0.1, 0.05, 0.05]


@pytest.mark.parametrize("bug", [None, "accept_drawn", "base_q"])
def test_chi_square_has_power(bug):
    """The dense reference passes; the same check rejects deliberately wrong rules."""
    V, shape = 5, [[[]], [], []]
    lm = ToyLM(V, 31, fixed={(): NEGATIVE_ROOT_P})
    drafter = ToyDrafter(ToyLM(V, 32, fixed={(): NEGATIVE_ROOT_Q}), 33)
    accept = lambda d, t, r: reference_accept(d, t, r, bug=bug)
    firsts, pairs = end_to_end_counts(accept, lm, drafter, shape, 20000, seed=6)
    want1, want2 = target_dists(lm)
    p1, p2 = chi2_pvalue(firsts, want1), chi2_pvalue(pairs, want2)
    if bug is None:
        assert p1 > ALPHA and p2 > ALPHA
    else:
        assert p1 < ALPHA and p2 < ALPHA


def test_sample_without_replacement_order_law():
    ids, probs = np.array([10, 11, 12, 13]), np.array([0.5, 0.3, 0.2, 0.0])
    rng = np.random.default_rng(2)
    counts = Counter(tuple(sample_without_replacement(ids, probs, 2, rng)) for _ in range(20000))
    q = dict(zip(ids.tolist(), probs))
    want = {(a, b): q[a] * q[b] / (1 - q[a]) for a in q for b in q if a != b and q[a] * q[b] > 0}
    assert chi2_pvalue(counts, want) > ALPHA
    # fewer than k non-zero entries: stops early, all distinct
    drawn = sample_without_replacement(ids, probs, 4, rng)
    assert sorted(drawn) == [10, 11, 12]
    assert sample_without_replacement(ids, np.zeros(4), 2, rng) == []


# --------------------------------------------------------------------------- properties, edges

@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 6), st.sampled_from([0.0, 0.5, 1.0]))
def test_one_hot_target_equals_greedy(seed, V, det_frac):
    """With a greedy target (one-hot rows) the stochastic rule is the greedy rule."""
    rng = np.random.default_rng(seed)

    def random_shape(d):
        return [] if d == 0 else [random_shape(d - 1) for _ in range(int(rng.integers(0, 4)))]

    lm = ToyLM(V, seed, styles=("onehot",))
    drafter = ToyDrafter(ToyLM(V, seed + 1), seed + 2, det_frac)
    draft = build_draft(random_shape(3), drafter, rng)
    rows = rows_array(draft, lm)
    assert accept_stochastic(draft, rows, rng) == accept_greedy(draft, rows.argmax(axis=1))


def test_seeded_determinism():
    V = 6
    lm = ToyLM(V, 40)
    drafter = ToyDrafter(ToyLM(V, 41), 42, det_frac=0.3)
    drafts = [build_draft([[[], []], [[]], []], drafter, np.random.default_rng(i)) for i in range(50)]

    def run(seed):
        rng = np.random.default_rng(seed)
        return [accept_stochastic(d, row_fn(d, lm), rng) for d in drafts]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert (sample_without_replacement(np.arange(6), np.full(6, 1 / 6), 3, np.random.default_rng(1))
            == sample_without_replacement(np.arange(6), np.full(6, 1 / 6), 3, np.random.default_rng(1)))


def test_lazy_rows_only_on_walked_path():
    V = 5
    lm = ToyLM(V, 50)
    drafter = ToyDrafter(ToyLM(V, 51), 52, det_frac=0.5)
    for i in range(200):
        draft = build_draft([[[[]], []], [[]], []], drafter, np.random.default_rng(i))
        asked = []

        def target(r, draft=draft, asked=asked):
            asked.append(r)
            return lm(prefix_of(draft, r - 1))

        acc = accept_stochastic(draft, target, np.random.default_rng(i))
        assert asked == [0] + [node + 1 for node in acc.path]  # once each, root first
        again = accept_stochastic(draft, rows_array(draft, lm), np.random.default_rng(i))
        assert again == acc  # array and function forms draw the same


def test_supports_and_vectors_give_the_same_walk():
    """A row given as its support (ids, probabilities) walks as its dense vector does, with the
    same generator: the same coins and draws, trees with recorded q and without."""
    V = 7
    lm = ToyLM(V, 60)
    for det_frac in (0.0, 0.5, 1.0):
        drafter = ToyDrafter(ToyLM(V, 61), 62, det_frac=det_frac)
        for i in range(300):
            draft = build_draft([[[[]], []], [[]], []], drafter, np.random.default_rng(i))

            def support(r, draft=draft):
                p = np.asarray(lm(prefix_of(draft, r - 1)), np.float64)
                ids = np.flatnonzero(p)
                return ids, p[ids]

            dense = accept_stochastic(draft, rows_array(draft, lm), np.random.default_rng(i))
            assert accept_stochastic(draft, support, np.random.default_rng(i)) == dense


class StubRng:
    """Returns fixed 'uniforms', to force branches a real generator reaches with prob ~0."""

    def __init__(self, u: float):
        self.u = u

    def random(self):
        return self.u


def test_vanished_residual_falls_back_to_p():
    # p == q: acceptance has probability 1; force a rejection with u = 1.0 so the residual
    # max(0, p - q) is all zero. It must not divide by zero; the bonus comes from p.
    p = np.array([0.25, 0.25, 0.5])
    draft = make_tree([2, 0], [-1, -1], [np.arange(3)] * 2, [p] * 2)
    acc = accept_stochastic(draft, np.stack([p, p, p]), StubRng(1.0))
    assert acc.path == () and acc.bonus in (0, 1, 2)


def test_zero_target_probability_never_accepted():
    p = np.array([0.0, 1.0, 0.0])
    q = np.array([1.0, 0.0, 0.0])
    draft = make_tree([0], [-1], [np.arange(3)], [q])
    for u in (0.0, 0.5, 0.999999):
        assert accept_stochastic(draft, np.stack([p, p]), StubRng(u)) == Acceptance((), 1)


def test_child_outside_q_is_skipped():
    # The only child's token is not in q at all: it is never accepted, and the bonus ~ p.
    p = np.array([0.2, 0.3, 0.5])
    draft = make_tree([2], [-1], [np.array([0, 1])], [np.array([0.5, 0.5])])
    rng = np.random.default_rng(3)
    counts = Counter()
    for _ in range(5000):
        acc = accept_stochastic(draft, np.stack([p, p]), rng)
        assert acc.path == ()
        counts[acc.bonus] += 1
    assert chi2_pvalue(counts, dict(enumerate(p))) > ALPHA
