"""The adaptive speculation policy: per step, draft only what pays for its verification.

Expected speed of a step = expected emitted tokens / expected step time. Step time comes from
calibration (target verify time as a function of tokens in the batch, drafter time per drafted
token); expected emitted tokens from online estimates of acceptance:

* suffix drafts carry a per-node score (the index's empirical probability of that path); a
  running calibration factor maps scores to observed acceptance,
* model chains use a running acceptance rate per depth.

Plain decoding (emit 1 token for T(1)) is always a candidate, so speculation never makes a step
slower in expectation. Everything here is a pure function of numbers or a small estimator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.spec.tree_search import accepted_by, accepted_path


@dataclass(frozen=True)
class CostModel:
    """Seconds per step: target verify time for n batch tokens, drafter time per drafted token."""

    batch_sizes: tuple[int, ...]  # increasing, starting at 1
    verify_s: tuple[float, ...]  # measured target time for each batch size
    draft_token_s: float = 0.0  # model drafter, per drafted token (0 when there is none)

    def __post_init__(self) -> None:
        # verify(n) for every n up to the largest size measured, interpolated once: the policy
        # prices every prefix of a draft each step, and one np.interp call costs ~6 us.
        xs, ys = np.asarray(self.batch_sizes, float), np.asarray(self.verify_s, float)
        table = np.interp(np.arange(int(xs[-1]) + 1, dtype=float), xs, ys) if len(xs) else np.zeros(0)
        object.__setattr__(self, "_table", table)

    def verify(self, n: int) -> float:
        """Target time for a batch of n tokens (linear interpolation, linear extrapolation)."""
        if 0 <= n < len(self._table) and n == int(n):
            return float(self._table[int(n)])
        xs, ys = np.asarray(self.batch_sizes, float), np.asarray(self.verify_s, float)
        if n <= xs[-1]:
            return float(np.interp(n, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1]
        return float(ys[-1] + slope * (n - xs[-1]))

    def verify_range(self, first: int, count: int) -> np.ndarray:
        """verify(n) for n = first .. first + count - 1, as one array."""
        end = first + count
        if end <= len(self._table):
            return self._table[first:end]
        return np.array([self.verify(n) for n in range(first, end)])


# A draft must promise this much more than a plain step: the estimates are noisy and every
# drafted step pays Python-side overhead the calibration does not see.
MARGIN = 0.1


def best_tree_prefix(path_probs: Sequence[float], cost: CostModel, max_nodes: int,
                     margin: float = MARGIN) -> tuple[int, float]:
    """How many nodes of a best-first draft to verify, and the expected tokens/s of doing so.

    Args:
        path_probs: for each node in drafting order, the estimated probability that the target
            accepts the whole path to it (a best-first order makes prefixes the best subtrees).
        cost: calibrated step times.
        max_nodes: cap on verified nodes.
    Returns:
        (m, rate): verify the first m nodes (0 = plain step); rate in tokens per second. A draft
        is chosen only when it beats a plain step by ``margin``.
    """
    plain = (1.0 + margin) / cost.verify(1)
    if len(path_probs[:max_nodes]) <= SMALL_DRAFT:
        return _loop_tree_prefix(path_probs[:max_nodes], cost, plain)
    probs = np.asarray(path_probs[:max_nodes], float)
    # expected tokens of each prefix, summed left to right as a running total would
    expected = np.cumsum(np.concatenate(([1.0], probs)))[1:]
    return _best(expected / cost.verify_range(2, len(probs)), plain)


# Up to this many nodes the running loop prices a draft faster than numpy's calls (3 nodes: 2.4
# against 11 us on the dev VM) and to the same bits: it is the definition the arrays follow.
SMALL_DRAFT = 16


def _loop_tree_prefix(probs: Sequence[float], cost: CostModel, plain: float) -> tuple[int, float]:
    best_m, best_rate, expected = 0, plain, 1.0
    for m, p in enumerate(probs, start=1):
        expected += p
        rate = expected / cost.verify(1 + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate


def best_chain_length(alphas: Sequence[float], cost: CostModel, max_len: int,
                      margin: float = MARGIN) -> tuple[int, float]:
    """Model-drafted chain length maximising expected tokens/s (0 = do not draft).

    A chain of k tokens costs k drafter passes plus a (1 + k)-token verification and emits
    1 + sum_{j<=k} prod_{d<=j} alpha_d tokens in expectation.
    """
    plain = (1.0 + margin) / cost.verify(1)
    if max_len < 1 or not len(alphas):
        return 0, plain
    a = np.asarray(alphas, float)
    per_depth = a[np.minimum(np.arange(1, max_len + 1), len(a)) - 1]
    expected = np.cumsum(np.concatenate(([1.0], np.cumprod(per_depth))))[1:]
    k = np.arange(1, max_len + 1, dtype=float)
    return _best(expected / (k * cost.draft_token_s + cost.verify_range(2, max_len)), plain)


def _best(rates: np.ndarray, plain: float) -> tuple[int, float]:
    """(1 + the index of the first highest rate, that rate) where it beats ``plain``, else (0, plain)."""
    rates = np.where(np.isnan(rates), -np.inf, rates)  # a NaN estimate never wins, as with `>`
    i = int(np.argmax(rates))
    return (i + 1, float(rates[i])) if rates[i] > plain else (0, plain)


class RatioEstimate:
    """Exponential moving average of a ratio, starting from a prior with a pseudo-count."""

    def __init__(self, prior: float, weight: float = 4.0, decay: float = 0.98):
        self.num, self.den, self.decay = prior * weight, weight, decay

    def update(self, observed: float, predicted: float) -> None:
        self.num = self.num * self.decay + observed
        self.den = self.den * self.decay + predicted

    @property
    def value(self) -> float:
        return self.num / self.den if self.den > 0 else 0.0

    def state(self) -> list[float]:
        return [self.num, self.den]

    def restore(self, state, weight: float) -> None:
        """Takes a saved [num, den], its evidence scaled down to at most ``weight``."""
        num, den = state
        scale = min(1.0, weight / den) if den > 0 else 0.0
        self.num, self.den = num * scale, den * scale


class DepthAcceptance:
    """Running acceptance rate of a chain drafter at each depth (1-based)."""

    def __init__(self, max_depth: int = 64, prior: float = 0.5):
        self.rates = [RatioEstimate(prior, weight=2.0, decay=0.97) for _ in range(max_depth)]

    def update(self, drafted: int, accepted: int) -> None:
        """A verified chain: depths 1..accepted were accepted, depth accepted+1 was rejected."""
        for d in range(min(drafted, accepted + 1, len(self.rates))):
            self.rates[d].update(1.0 if d < accepted else 0.0, 1.0)

    def alphas(self) -> list[float]:
        return [min(max(r.value, 0.0), 1.0) for r in self.rates]

    def state(self) -> list[list[float]]:
        return [r.state() for r in self.rates]

    def restore(self, state, weight: float) -> None:
        """Takes a saved state, each depth's evidence scaled down to at most ``weight``."""
        for r, saved in zip(self.rates, state):
            r.restore(saved, weight)


def _carry(num, den, state, weight: float) -> None:
    """Copies a saved ``[nums, dens]`` into ``num`` / ``den``, each entry's evidence scaled down
    to at most ``weight`` pseudo-observations; entries without saved evidence keep their own."""
    for i, (n, d) in enumerate(zip(*state)):
        if i < len(num) and d > 0:
            scale = min(1.0, weight / d)
            num[i], den[i] = n * scale, d * scale


class ConfidenceCalibration:
    """Maps a model drafter's confidence in a drafted token (its probability of its own greedy
    choice) to the probability that the target agrees, learned from verified chains.

    One estimate per confidence bin, starting from the drafter's own word: a token of
    confidence c is worth (hits + weight * c) / (tokens + weight) of its bin. On Spec-Bench the
    0.5B drafter's tokens of confidence 0.0-0.1 agreed with the 1.5B target 21% of the time and
    those of 0.9-1.0 99% (benchmarks/replay/traces/specbench-30.json.gz): it is least
    calibrated where it is unsure, which the bins learn within a request.
    """

    BINS = 10

    def __init__(self, weight: float = 2.0, decay: float = 0.995):
        self.weight, self.decay = weight, decay
        self.num = np.zeros(self.BINS)
        self.den = np.zeros(self.BINS)

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.BINS), 0), self.BINS - 1)

    def value(self, confidence: float) -> float:
        b = self._bin(confidence)
        return float((self.num[b] + self.weight * confidence) / (self.den[b] + self.weight))

    def path_probs(self, confidences: Sequence[float]) -> list[float]:
        """Estimated probability that the target accepts a chain through each of its tokens."""
        out, survive = [], 1.0
        for c in confidences:
            survive *= self.value(c)
            out.append(survive)
        return out

    def update(self, confidences: Sequence[float], hits: Sequence[bool]) -> None:
        """Learns from a chain's tokens graded against the target's continuation, up to the
        first miss (the tokens after it were drafted from a context the target left)."""
        for c, hit in zip(confidences, hits):
            b = self._bin(c)
            self.num *= self.decay
            self.den *= self.decay
            self.num[b] += float(hit)
            self.den[b] += 1.0
            if not hit:
                break

    def state(self) -> list[list[float]]:
        return [self.num.tolist(), self.den.tolist()]

    def restore(self, state, weight: float) -> None:
        """Takes a saved state, each bin's evidence scaled down to at most ``weight``."""
        _carry(self.num, self.den, state, weight)


class ChainStop:
    """Where a confidence-sized greedy chain stops (edgespec.drafters.auto.drafter): once its
    next token, were it surely right, would be worth less than drafting it costs. A token is
    worth the seconds per token of the best step on offer: a prefix drafted so far, ``floor``
    (the suffix index's draft, tokens/s), a plain step. Called once per drafted token with its
    confidence; keeps running sums, so O(1) a token."""

    def __init__(self, calibration: ConfidenceCalibration, cost: CostModel, floor: float = 0.0):
        self.calibration, self.cost = calibration, cost
        self.tokens, self.survive, self.expected = 0, 1.0, 1.0
        self.rate = max(1.0 / cost.verify(1), floor)

    def __call__(self, confidence: float) -> bool:
        """Adds a drafted token; True: stop drafting after it."""
        self.tokens += 1
        self.survive *= self.calibration.value(confidence)
        self.expected += self.survive
        self.rate = max(self.rate, self.expected / self.cost.verify(self.tokens + 1))
        return self.survive / self.rate < self.cost.draft_token_s


def chain_rate(chains: Sequence[Sequence[float]], calibration: ConfidenceCalibration, cost: CostModel,
               budget: int) -> float:
    """Expected tokens/s of drafting ``chains`` (each a greedy chain's confidences, as far as the
    drafter would run it) the way `auto` drafts them: stopped by ChainStop against a plain
    step, its best prefix verified (a plain step when none pays; the drafting is paid anyway)."""
    emitted = seconds = 0.0
    for chain in chains:
        stop, drafted = ChainStop(calibration, cost), 0
        for confidence in chain[:budget]:
            drafted += 1
            if stop(confidence):
                break
        probs = calibration.path_probs(chain[:drafted])
        m, _ = best_tree_prefix(probs, cost, drafted)
        emitted += 1.0 + sum(probs[:m])
        seconds += drafted * cost.draft_token_s + cost.verify(1 + m)
    return emitted / seconds if seconds > 0 else 0.0


# A drafter model's chains before `auto` has seen any here: the lengths of the 0.5B drafter's
# greedy chains at confidence >= 0.4 from every output position of the Spec-Bench tuning
# questions (16 quantiles, capped at 32; benchmarks/replay/traces/specbench-30.json.gz), each
# token at confidence 0.9. Priced with these chains, the real chains' price is reproduced at
# 0.95 (within 3-7% on the GPU placements' curves); 0.9 leaves room for what the price does
# not see (the drafter's sync, steps the suffix index's draft wins anyway): on the 2-core VM,
# where the drafter measured slower than suffix drafts alone, 0.95 would sit on the margin.
PRIOR_CHAIN_LENGTHS = (0, 0, 1, 2, 4, 6, 9, 13, 19, 29, 32, 32, 32, 32, 32, 32)
PRIOR_CHAIN_CONFIDENCE = 0.9


def drafter_gain(cost: CostModel, budget: int, learned: Sequence[float] | None = None) -> float:
    """What a drafter model's chains gain over the steps `auto` takes without them (> 1: it
    pays): as measured on this placement (``learned``: [num, den] of emitted tokens over the
    tokens the suffix draft or a plain step was expected to emit in the same seconds), else
    priced on PRIOR_CHAIN_LENGTHS against a plain step with ``MARGIN``."""
    if learned is not None and learned[1] > 0:
        return learned[0] / learned[1]
    prior = [(PRIOR_CHAIN_CONFIDENCE,) * n for n in PRIOR_CHAIN_LENGTHS]
    return chain_rate(prior, ConfidenceCalibration(), cost, budget) * cost.verify(1) / (1.0 + MARGIN)


def path_probabilities(parents: Sequence[int], node_probs: Sequence[float]) -> list[float]:
    """Probability of reaching each node: the product of node probabilities along its path."""
    out: list[float] = []
    for i, p in enumerate(parents):
        out.append(node_probs[i] * (out[p] if p >= 0 else 1.0))
    return out


class TreeDepthCalibration:
    """Maps a suffix tree's scores to acceptance probabilities, one factor per depth.

    A node's conditional score (its score over its parent's: the index's frequency of that
    continuation) is multiplied by the factor of its depth, learned as observed hits over
    predicted ones. Depth matters: the index's frequencies are sharper near a long match than
    deep into the draft, where a copy drifts from its source. A depth without data inherits the
    factor of the depth above it (a hierarchical prior), so deep drafts are neither ruled out
    before they were ever tried nor trusted more than shallow ones.
    """

    def __init__(self, max_depth: int = 64, prior: float = 0.5, weight: float = 3.0, decay: float = 0.98):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.num = [0.0] * max_depth
        self.den = [0.0] * max_depth

    def state(self) -> list[list[float]]:
        return [list(self.num), list(self.den)]  # a copy: it is written beside the next request

    def restore(self, state, weight: float) -> None:
        """Takes a saved state, each depth's evidence scaled down to at most ``weight``."""
        _carry(self.num, self.den, state, weight)

    def factors(self, depths: int | None = None) -> list[float]:
        """Each depth's factor, the first ``depths`` of them (all: None)."""
        out, above = [], self.prior
        for num, den in zip(self.num[:depths], self.den[:depths]):
            above = (num + self.weight * above) / (den + self.weight)
            out.append(above)
        return out

    def path_probs(self, parents: Sequence[int], scores: Sequence[float]) -> list[float]:
        """Estimated probability that the target accepts the path to each node."""
        factors = self.factors(len(parents))  # a node's depth is below the tree's size
        probs: list[float] = []
        depths: list[int] = []
        for i, p in enumerate(parents):
            depth = 0 if p < 0 else depths[p] + 1
            depths.append(depth)
            base = 1.0 if p < 0 else scores[p]
            cond = scores[i] / base if base > 0 else 0.0
            f = factors[min(depth, len(factors) - 1)]
            probs.append(min(1.0, max(0.0, cond * f)) * (1.0 if p < 0 else probs[p]))
        return probs

    def update(self, tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float],
               truth: Sequence[int]) -> None:
        """Learns from a tree whose first ``len(truth)`` correct tokens are now known.

        Walks the tree along ``truth``: at each depth the children of the node reached predict
        (sum of their conditional scores) and hit when one of them is the true token.
        """
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):  # each node's children in drafting order, found once
            children.setdefault(p, []).append(i)
        node = -1
        for depth, true_token in enumerate(truth):
            if depth >= len(self.num):
                break
            base = 1.0 if node < 0 else scores[node]
            kids = children.get(node, [])
            if not kids or base <= 0:
                break
            predicted = min(1.0, sum(scores[i] for i in kids) / base)
            hit = next((i for i in kids if int(tokens[i]) == int(true_token)), None)
            self.num[depth] = self.num[depth] * self.decay + (1.0 if hit is not None else 0.0)
            self.den[depth] = self.den[depth] * self.decay + predicted
            if hit is None:
                break
            node = hit


# What best-first trees of the 0.5B drafter accept per size before any is verified here: the mean
# per step of a replay drafting every step's largest tree over the Spec-Bench tuning questions
# (benchmarks/replay/traces/specbench-30.json.gz). A prior of every node accepted drafted 63-node
# trees for little at a Spec-Bench answer's first 16 steps (replayed beside a 7B offload).
PRIOR_TREE_ACCEPTED = {3: 1.76, 7: 3.08, 15: 4.45, 31: 5.88, 63: 7.23}


class TreeSizes:
    """Which size of best-first model tree pays (edgespec.spec.tree_search), learned as a level
    and a shape.

    Trees are nested: a verified tree tells what every smaller size would have accepted, nothing
    of larger ones. So the level (what the smallest size accepts: a fast average, ``decay``) follows
    the text, and the shape (what each larger size accepts over it: slow, ``shape_decay``) learns
    only from trees that reached that size; a size is expected to accept their product (replayed
    on a 7B offload: 4.77x, where one average per size gave 4.50x). After a step without a tree,
    ``choose`` moves the level ``revert`` of the way back to its prior (PRIOR_TREE_ACCEPTED), so
    trees that stopped paying are priced again (replayed code edits: 4.99x, 4.61x never reverting).
    A search's seconds are learned (``searched``); every ``probe_every`` steps ``choose`` drafts the
    largest allowed size (``probing``), so sizes it stopped choosing keep being measured.
    """

    def __init__(self, sizes: Sequence[int], decay: float = 0.8, probe_every: int = 16,
                 shape_weight: float = 4.0, shape_decay: float = 0.99, revert: float = 0.1):
        self.sizes = tuple(sorted(sizes))
        self.decay, self.probe_every, self.revert = decay, probe_every, revert
        prior = PRIOR_TREE_ACCEPTED if set(self.sizes) <= set(PRIOR_TREE_ACCEPTED) else {b: b for b in self.sizes}
        self.prior_level = self.level = prior[self.sizes[0]]  # moving average of what the smallest size accepted
        self.shape = {b: RatioEstimate(prior[b] / self.level, shape_weight, shape_decay) for b in self.sizes[1:]}
        self.search_s: dict[int, float] = {}  # size -> moving average of a search's seconds
        self.steps = 0
        self._evidence = False  # a tree was learned from since the last choice (no revert then)

    @property
    def probing(self) -> bool:
        """Whether the last ``choose`` drafted the largest size to measure it, not because it pays."""
        return self.steps % self.probe_every == 1

    def expected(self, size: int) -> float:
        """Tokens a tree of ``size`` (one of ``sizes``) is expected to accept."""
        return min(float(size), self.level * (self.shape[size].value if size != self.sizes[0] else 1.0))

    def learn(self, tree, emitted: Sequence[int]) -> None:
        """What ``tree`` (best first, a DraftTree or None) and each smaller size accepted of ``emitted``."""
        if tree is None or len(tree) < self.sizes[0]:
            return
        accepted = accepted_by(accepted_path(tree, emitted), [b for b in self.sizes if b <= len(tree)])
        base = float(accepted.pop(self.sizes[0]))
        self._evidence = True
        self.level = self.decay * self.level + (1 - self.decay) * base
        for b, a in accepted.items():
            self.shape[b].update(float(a), base)

    def searched(self, size: int, seconds: float) -> None:
        if size in self.sizes:
            old = self.search_s.get(size)
            self.search_s[size] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def size(self, limit: int, cost: CostModel | None = None) -> int:
        """The tree size for a step allowing ``limit`` nodes: the policy's choice with a cost
        model, else the largest size within the limit (0: none fits, or a plain step pays more)."""
        if cost is None:
            return max([b for b in self.sizes if b <= limit], default=0)
        return self.choose(cost, limit)

    def rate(self, cost: CostModel, size: int) -> float:
        """Expected tokens per second of drafting and verifying a tree of ``size``."""
        search = self.search_s.get(size, size * cost.draft_token_s)
        return (1.0 + self.expected(size)) / (cost.verify(size + 1) + search)

    def choose(self, cost: CostModel, limit: int, margin: float = MARGIN) -> int:
        """The tree size to draft (0: a plain step pays more)."""
        allowed = [b for b in self.sizes if b <= limit]
        if not allowed:
            return 0
        self.steps += 1
        if not self._evidence:  # the last step drafted no tree: nothing measured the level
            self.level += (self.prior_level - self.level) * self.revert
        self._evidence = False
        if self.probing:
            return allowed[-1]
        best = max(allowed, key=lambda b: self.rate(cost, b))
        return best if self.rate(cost, best) > (1.0 + margin) / cost.verify(1) else 0
