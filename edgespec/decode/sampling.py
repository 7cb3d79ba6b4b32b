"""The target distribution: logits -> probabilities under the user's sampler settings.

Plain generation, drafting and speculative verification all take the distribution from
``target_support`` (``target_probs`` spreads it over the vocabulary) so that speculation can never
change what is sampled. The order of the transforms follows llama.cpp's
default chain: repetition penalty -> top-k -> top-p -> min-p -> temperature. Everything here is
a pure function of numpy arrays; no llama.cpp.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.errors import InvalidRequest

# top-p needs the probabilities sorted; sorting a 150k vocabulary per token costs ~10 ms, so we
# first try the largest few hundred and only sort everything when they hold less than top_p.
_TOP_P_FAST_CANDIDATES = 512


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings of one request. ``temperature == 0`` means greedy.

    top_k = 0 disables top-k; top_p = 1 and min_p = 0 disable those filters;
    repeat_penalty = 1 disables the penalty over the last ``repeat_last_n`` tokens.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0 and np.isfinite(self.temperature), "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p < 1.0, "min_p must be in [0, 1)"),
            (self.repeat_penalty > 0 and np.isfinite(self.repeat_penalty),
             "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            # numpy's generators take any integer >= 0 (no upper bound) and refuse negative ones.
            (self.seed is None or (isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool)
                                   and self.seed >= 0), f"seed must be an integer >= 0 or None, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repeat_penalty(logits: np.ndarray, recent: np.ndarray, penalty: float) -> np.ndarray:
    """llama.cpp's repetition penalty: divide positive, multiply negative logits of recent tokens.

    Args:
        logits: [n_vocab] float logits (not modified).
        recent: token ids seen in the penalty window (duplicates count once).
        penalty: > 1 discourages repetition; 1 is a no-op.
    Returns:
        A new [n_vocab] array.
    """
    if penalty == 1.0 or len(recent) == 0:
        return logits
    out = logits.copy()
    ids = np.unique(recent)
    out[ids] = _penalized(out[ids], penalty)
    return out


def _penalized(values: np.ndarray, penalty: float) -> np.ndarray:
    """Recent tokens' logits under the penalty: positive ones divided, negative ones multiplied."""
    return np.where(values > 0, values / penalty, values * penalty)


def greedy_token(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> int:
    """The token plain greedy decoding picks: argmax after the repetition penalty."""
    return int(np.argmax(apply_repeat_penalty(logits, recent, params.repeat_penalty)))


def logsumexp(row: np.ndarray, top=None) -> float:
    """log(sum(exp(row))) of a logits row, the normaliser of its log-probabilities. The
    exponentials stay in the row's own precision (float32 from llama.cpp) and are summed in
    float64: log-probabilities within 2e-8 of float64 throughout on the 0.5B's rows, and a greedy
    pick 0.21 ms against 0.54 (benchmarks/results/logits-rows.json). A drafter pays this for
    every token it drafts. ``top``: the row's largest entry, where the caller has read it."""
    m = row.max() if top is None else top
    d = row - m
    np.exp(d, out=d)
    return float(m) + math.log(float(d.sum(dtype=np.float64)))


# top_ids samples every TOP_STRIDE-th entry of a row to set a threshold that about
# (ceil(k / TOP_STRIDE) + 2) * TOP_STRIDE entries pass: the top k lie among those, found without
# partitioning the whole vocabulary. On the 0.5B's rows (dev VM): k = 8 in 0.08 ms, k = 40 in
# 0.11 ms, against 0.25 ms for a partition of the row; the same on flat rows (a shape clone's).
TOP_STRIDE = 64


def top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of ``row``'s ``k`` largest entries (all of them if it has fewer), in no order
    (which of equal entries at the boundary is arbitrary, as with a partition of the row). NaN
    entries rank below every number, -inf ones below every finite one."""
    n = len(row)
    k = min(k, n)
    sample = row[::TOP_STRIDE]
    j = -(-k // TOP_STRIDE) + 2
    if j < len(sample):
        threshold = np.partition(sample, len(sample) - j)[len(sample) - j]
        if np.isfinite(threshold):  # not a row masked (-inf) or broken (NaN) around its sample
            near = np.flatnonzero(row >= threshold)
            if len(near) >= k:  # every entry above the threshold is in, so the top k are
                return near[np.argpartition(row[near], len(near) - k)[len(near) - k:]]
    return np.argpartition(-row, k - 1)[:k]


def greedy_logprob(logits: np.ndarray) -> tuple[int, float]:
    """A row's argmax token and its log-probability, without a row of log-probabilities: a
    drafted chain's pick (0.21 ms for a 152k-token row on the dev VM)."""
    token = int(np.argmax(logits))
    top = logits[token]
    return token, float(top) - logsumexp(logits, top)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """A whole row's log-probabilities in float64 (the trace recorders'; drafting reads two entries)."""
    return x.astype(np.float64) - logsumexp(x)


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def _top_p_keep(probs: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray:
    """Ids (sorted by descending probability) of the smallest prefix whose mass reaches top_p."""
    order = np.argsort(-probs[ids], kind="stable")
    ids = ids[order]
    cum = np.cumsum(probs[ids])
    if cum[-1] < top_p:
        return ids
    cut = int(np.searchsorted(cum, top_p, side="left")) + 1
    return ids[:cut]


def candidate_ids(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Token ids that survive top-k, top-p and min-p (before temperature).

    Args:
        logits: [n_vocab] logits after the repetition penalty.
    Returns:
        int array of surviving ids (in no particular order).
    """
    n = logits.shape[0]
    if params.top_k and params.top_k < n:
        ids = top_ids(logits, params.top_k)
    else:
        ids = np.arange(n)
    probs = np.zeros(n, dtype=np.float64)
    probs[ids] = _softmax(logits[ids].astype(np.float64))
    if params.top_p < 1.0:
        if len(ids) > _TOP_P_FAST_CANDIDATES:
            head = ids[np.argpartition(-probs[ids], _TOP_P_FAST_CANDIDATES - 1)[:_TOP_P_FAST_CANDIDATES]]
            # The cut is inside the head exactly when the head already holds top_p of the mass.
            ids = head if probs[head].sum() >= params.top_p else ids
        ids = _top_p_keep(probs, ids, params.top_p)
    if params.min_p > 0.0:
        ids = ids[probs[ids] >= params.min_p * probs[ids].max()]
    return ids


def target_support(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``target_probs``'s nonzero entries: token ids in ascending order and their probabilities.
    Sampling reads only these (40 under the default top-k), not the vocabulary: a drafted
    token's sampled pick costs 0.27 ms of the real 0.5B's 152k-token rows where the whole vector
    and its scan cost 1.13 ms (dev VM, benchmarks/results/logits-rows.json)."""
    penalized = apply_repeat_penalty(logits, recent, params.repeat_penalty)
    if params.greedy:
        return np.array([int(np.argmax(penalized))]), np.ones(1)
    return _support(penalized, params)


def _support(penalized: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Sampling's support among ``penalized`` (a row's logits after the penalty, or those of its
    candidates in ascending token order): positions in ascending order and their probabilities."""
    ids = np.sort(candidate_ids(penalized, params))
    probs = _softmax(penalized[ids].astype(np.float64) / params.temperature)
    keep = probs != 0.0  # the entries sample_from reads from the whole vector (flatnonzero)
    return ids[keep], probs[keep]


def backend_top_k(params: SamplingParams) -> int:
    """How many of a row's largest logits hold its whole ``target_support``, so that the backend
    may return those instead of the row (edgespec.llama.rows); 0 where none do. The penalty
    lowers recent tokens only (penalty > 1), so at most ``repeat_last_n`` of them drop out of
    the top; a penalty below 1 can raise any token, and without top-k every token may count."""
    if params.greedy or params.top_k == 0 or params.repeat_penalty < 1.0:
        return 0
    return params.top_k + (params.repeat_last_n if params.repeat_penalty > 1.0 else 0)


def support_of_top(ids: np.ndarray, logits: np.ndarray, params: SamplingParams,
                   recent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``target_support`` of a row of which only its ``backend_top_k(params)`` largest logits
    (``logits`` at token ``ids``, in any order) are known: the same ids and probabilities."""
    order = np.argsort(ids)
    ids, values = ids[order], logits[order]
    if params.repeat_penalty != 1.0 and len(recent):
        hit = np.isin(ids, recent)
        values = values.copy()
        values[hit] = _penalized(values[hit], params.repeat_penalty)
    if params.greedy:
        return ids[[int(np.argmax(values))]], np.ones(1)
    where, probs = _support(values, params)
    return ids[where], probs


def target_probs(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> np.ndarray:
    """The exact distribution plain sampling draws the next token from.

    Args:
        logits: [n_vocab] raw logits of one position.
        params: the request's sampler settings; greedy gives a one-hot at the argmax.
        recent: token ids in the repetition-penalty window.
    Returns:
        [n_vocab] float64 probabilities summing to 1 (``target_support`` spread over the vocabulary).
    """
    ids, p = target_support(logits, params, recent)
    probs = np.zeros(logits.shape[0], dtype=np.float64)
    probs[ids] = p
    return probs


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability vector with the request's generator.

    Uses inverse-CDF sampling on the non-zero entries so one uniform draw is spent per token,
    which keeps seeded runs reproducible whatever the vocabulary size.
    """
    ids = np.flatnonzero(probs)
    return sample_support(ids, probs[ids], rng)


def sample_support(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """``sample_from`` of the vector whose nonzero entries are ``probs`` at ``ids`` (ascending):
    the same draw from the same generator state."""
    cum = np.cumsum(probs)
    u = rng.random() * cum[-1]
    return int(ids[min(int(np.searchsorted(cum, u, side="right")), len(ids) - 1)])


def recent_window(history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """Token ids in the repetition-penalty window (prompt included, as llama.cpp does)."""
    n = params.repeat_last_n if params.repeat_penalty != 1.0 else 0
    return np.asarray(history[-n:] if n else [], dtype=np.int64)


def pick_token(logits: np.ndarray, params: SamplingParams, history: Sequence[int],
               rng: np.random.Generator) -> int:
    """The next token of plain decoding: argmax or a draw from the exact target distribution."""
    return _pick(target_support(logits, params, recent_window(history, params)), params, rng)


def _pick(support: tuple[np.ndarray, np.ndarray], params: SamplingParams, rng: np.random.Generator) -> int:
    """The token plain decoding takes from a row's ``target_support``: its one id when greedy,
    else a draw."""
    ids, probs = support
    return int(ids[0]) if params.greedy else sample_support(ids, probs, rng)


def argmax_decides(params: SamplingParams) -> bool:
    """Whether a row's argmax alone is the next token (greedy, no repetition penalty), so the
    backend may pick it and copy back no logits (edgespec.llama.rows)."""
    return params.greedy and params.repeat_penalty == 1.0


def row_support(row, params: SamplingParams, recent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``target_support`` of a decoded row (edgespec.llama.rows.Row): from the largest logits
    where the backend returned only those, else from the row's logits."""
    top = row.top()
    if top is not None:
        return support_of_top(top[0], top[1], params, recent)
    return target_support(row.logits(), params, recent)


def pick_from_row(row, params: SamplingParams, history: Sequence[int], rng: np.random.Generator) -> int:
    """``pick_token`` for a decoded row (edgespec.llama.rows.Row): its logits are read only when
    the argmax alone does not decide, and only its largest where the backend returns those."""
    if argmax_decides(params):
        return row.greedy()
    return _pick(row_support(row, params, recent_window(history, params)), params, rng)


def top2_gap(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> float:
    """How far greedy's choice leads the runner-up, in logits (after the repetition penalty)."""
    top = np.partition(apply_repeat_penalty(logits, recent, params.repeat_penalty), -2)[-2:]
    return float(top[1] - top[0])
