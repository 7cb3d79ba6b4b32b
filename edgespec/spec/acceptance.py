"""Acceptance rules: which drafted tokens a verification step keeps, and the bonus token.

Verification of a draft of ``n`` nodes gives the target's next-token distribution at the root
(row 0, after the last context token) and after each node (row ``i + 1``, after node ``i``).
The rules here walk the draft tree from the root and return the accepted path plus the bonus
token, so that a step emits ``tokens[path] + [bonus]``.

* ``accept_greedy`` - temperature 0: keep drafted tokens while they equal the target's argmax.
* ``accept_stochastic`` - sampling: the emitted tokens are distributed exactly as if the target
  had sampled them one by one (speculative sampling of Leviathan et al. 2023 and Chen et al.
  2023 for chains; multi-draft recursive rejection sampling without replacement, as in
  SpecInfer (Miao et al. 2024) and Sequoia (Chen et al. 2024), for sibling drafts).

Exactness of ``accept_stochastic`` on model drafts rests on the drafter: each sibling group
must be the first draws, in order, of ``sample_without_replacement`` from the recorded q (the
real sampling distribution after the drafter's own temperature / top-k, ids distinct).
Truncating a group to its first k draws is fine; reordering siblings (e.g. by probability) or
dropping draws by their value is not.

Pure functions of numpy arrays; no llama.cpp.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgespec.decode.tree import DraftTree
from edgespec.decode.sampling import sample_from, sample_support

# A row's target distribution as its support: token ids in ascending order and their
# probabilities (edgespec.decode.sampling.target_support), or a dense [V] vector.
Support = tuple[np.ndarray, np.ndarray]

# A residual whose mass is below this fraction of its row is treated as empty. Reaching a
# residual costs a rejection whose probability equals that residual's (unnormalized) mass, so
# what we do then affects outcomes of probability <= 1e-12 - but it must not divide by ~0.
_VANISHED = 1e-12


@dataclass(frozen=True)
class Acceptance:
    """Outcome of one verification step.

    Attributes:
        path: accepted node indices from the root down (may be empty).
        bonus: the target's token after the last accepted node.
    """

    path: tuple[int, ...]
    bonus: int

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    def accepted_tokens(self, draft: DraftTree) -> list[int]:
        """Token ids of the accepted nodes, in order."""
        tokens = draft.tokens.tolist()
        return [tokens[i] for i in self.path]

    def emitted_tokens(self, draft: DraftTree) -> list[int]:
        """What the step adds to the output: accepted tokens then the bonus (>= 1 token)."""
        return self.accepted_tokens(draft) + [int(self.bonus)]


def _children_lists(draft: DraftTree) -> dict[int, list[int]]:
    """node (-1 = root) -> its children in drawing order, built in one pass."""
    kids: dict[int, list[int]] = {}
    for i, parent in enumerate(draft.parents.tolist()):
        kids.setdefault(parent, []).append(i)
    return kids


def accept_greedy(draft: DraftTree, target_argmax: np.ndarray) -> Acceptance:
    """Longest path of drafted tokens that equal the target's greedy choice.

    Args:
        draft: the verified draft tree (``n`` nodes).
        target_argmax: [n+1] the target's greedy token at each row (row 0 = root, row i+1 =
            after node i).
    Returns:
        The accepted path (each token equals the argmax at its parent's row) and the bonus =
        argmax at the last accepted node's row. Among siblings with the same token the first
        in drawing order wins.
    """
    # (parent, token) -> the first such child in drawing order: one probe a row, not a scan
    child: dict[tuple[int, int], int] = {}
    for i, key in enumerate(zip(draft.parents.tolist(), draft.tokens.tolist())):
        child.setdefault(key, i)
    path: list[int] = []
    node = -1
    while True:
        want = int(target_argmax[node + 1])
        nxt = child.get((node, want))
        if nxt is None:
            return Acceptance(tuple(path), want)
        path.append(nxt)
        node = nxt


def sample_without_replacement(q_ids: np.ndarray, q_probs: np.ndarray, k: int,
                               rng: np.random.Generator) -> list[int]:
    """Draw up to ``k`` distinct tokens sequentially from a sparse draft distribution.

    Draw ``j`` comes from ``q`` with draws ``0..j-1`` zeroed and renormalized - the order
    semantics ``accept_stochastic`` assumes for siblings. Stops early when ``q`` runs out of
    mass (fewer than ``k`` non-zero entries).

    Args:
        q_ids: [m] token ids (distinct).
        q_probs: [m] their probabilities (need not be normalized).
        k: how many siblings to draw.
        rng: the request's generator (one uniform per draw, via ``sample_from``).
    Returns:
        The drawn token ids, in drawing order.
    """
    weights = np.array(q_probs, dtype=np.float64)  # [m] copy: drawn entries get zeroed
    out: list[int] = []
    for _ in range(k):
        if not (weights > 0).any():
            break
        pos = sample_from(weights, rng)  # sample_from normalizes by the remaining mass
        out.append(int(q_ids[pos]))
        weights[pos] = 0.0
    return out


def _draft_q(draft: DraftTree, child: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The recorded draft distribution a sibling group was drawn from, or None."""
    if not draft.stochastic or draft.q_ids[child] is None or draft.q_probs[child] is None:
        return None
    return np.asarray(draft.q_ids[child]), np.asarray(draft.q_probs[child], dtype=np.float64)


def _as_support(p: Support | np.ndarray) -> Support:
    """A row's distribution as (ids ascending, probabilities): a dense vector's nonzero entries,
    which ``sample_support`` draws from exactly as ``sample_from`` draws from the vector."""
    if isinstance(p, tuple):
        return np.asarray(p[0]), np.asarray(p[1], dtype=np.float64)
    p = np.asarray(p)
    ids = np.flatnonzero(p)
    return ids, p[ids].astype(np.float64)


def _verify_siblings(p: Support, children: list[int], draft: DraftTree,
                     q_ids: np.ndarray, q_base: np.ndarray,
                     rng: np.random.Generator) -> tuple[int | None, int | None]:
    """Recursive rejection sampling over siblings drawn without replacement from one q.

    Each stage is one speculative-sampling step (Leviathan et al. 2023): ``x_k ~ q_k`` is kept
    with probability ``min(1, r(x_k) / q_k(x_k))``, otherwise the result must be drawn from
    ``norm(max(0, r - q_k))``. Instead of drawing it directly we hand that residual to the next
    sibling as its target (SpecInfer / Sequoia). The next sibling was drawn from ``q_{k+1}`` =
    ``q_k`` with ``x_k`` zeroed whatever ``x_k`` was, so by induction every stage outputs its
    own ``r`` exactly, and stage 0 outputs ``p``. Zeroing ``x_k`` wastes nothing: a rejection
    needs ``r(x_k) < q_k(x_k)``, so the residual has no mass at ``x_k`` any more.

    Every residual lives on ``p``'s support (``max(0, 0 - q)`` is 0), so it is kept there: a
    row costs what its support holds (40 tokens under the default top-k), not the vocabulary.

    Args:
        p: the target's distribution at the parent's row (ids ascending, probabilities).
        children: sibling node indices in drawing order.
        q_ids, q_base: [m] the parent's draft distribution (before any sibling was removed).
    Returns:
        (accepted child, None) or (None, bonus token drawn from the last residual).
    """
    ids, probs = p
    z_row = float(probs.sum())
    residual, z = probs, z_row  # residual is unnormalized (over ids); z is its mass
    weights = q_base.copy()  # [m] q with earlier siblings zeroed (unnormalized)
    at = np.minimum(np.searchsorted(ids, q_ids), len(ids) - 1)
    on = ids[at] == q_ids  # [m] q's ids that are in p's support, at residual[at]
    for child in children:
        token = int(draft.tokens[child])
        hit = np.flatnonzero(q_ids == token)
        mass = float(weights.sum())
        qx = float(weights[hit[0]]) / mass if len(hit) and mass > 0 else 0.0
        if qx <= 0.0:
            # Not drawable from q_k (a duplicate sibling, or a token outside q): it carries no
            # information about r, so skip it and leave r and q_k unchanged.
            continue
        # Accept with probability min(1, (r(x)/z) / q_k(x)), without dividing: r(x) = 0 never
        # accepts, r(x) >= z q_k(x) always does (u < 1).
        rx = float(residual[at[hit[0]]]) if on[hit[0]] else 0.0
        if rng.random() * qx * z < rx:
            return child, None
        if residual is probs:
            residual = probs.copy()
        # r <- max(0, r - q_k): only q's ids in the support change (scaled to r's mass), and
        # the new mass follows from those entries alone.
        old = residual[at[on]]
        new = np.maximum(old - z * (weights[on] / mass), 0.0)
        residual[at[on]] = new
        z -= float((old - new).sum())
        if z <= _VANISHED * z_row:
            # p <= q_k everywhere, so the rejection had probability ~0; don't divide by ~0.
            return None, sample_support(ids, probs, rng)
        weights[hit[0]] = 0.0
    keep = residual > 0
    return None, sample_support(ids[keep], residual[keep], rng)


def accept_stochastic(draft: DraftTree,
                      target_p: Callable[[int], Support | np.ndarray] | np.ndarray,
                      rng: np.random.Generator) -> Acceptance:
    """Exact acceptance under sampling: emitted tokens are distributed as target samples.

    Walks from the root. At the current node's row with children ``C``:

    * no children: bonus ~ p(row);
    * children drawn from a recorded draft distribution (``draft.q_ids``): recursive
      rejection sampling over the siblings without replacement (see ``_verify_siblings``);
    * deterministic children (no q): draw ``x ~ p(row)``; move to the first child whose token
      is ``x``, else ``x`` is the bonus. Exact for any tree, since ``x`` is the target's draw.

    After accepting a child the walk continues at that child's row with the target's own
    distribution there: the residuals only ever concern the row they were built at.

    Args:
        draft: the verified draft tree (``n`` nodes).
        target_p: [n+1, V] the target's probabilities per row (row 0 = root, row i+1 = after
            node i), or a function of the row, giving its support (ids ascending, probabilities)
            or a [V] vector, so only rows on the walked path get computed.
        rng: the request's generator (``rng.random()`` for coins, ``sample_from`` for draws).
    Returns:
        The accepted path and the bonus token.
    """
    row_p = target_p if callable(target_p) else target_p.__getitem__
    kids = _children_lists(draft)
    path: list[int] = []
    node = -1
    while True:
        p = _as_support(row_p(node + 1))
        children = kids.get(node, [])
        q = _draft_q(draft, children[0]) if children else None
        if q is not None:
            nxt, bonus = _verify_siblings(p, children, draft, q[0], q[1], rng)
        elif children:
            x = sample_support(*p, rng)
            nxt = next((c for c in children if int(draft.tokens[c]) == x), None)
            bonus = None if nxt is not None else x
        else:
            nxt, bonus = None, sample_support(*p, rng)
        if nxt is None:
            return Acceptance(tuple(path), int(bonus))
        path.append(nxt)
        node = nxt
