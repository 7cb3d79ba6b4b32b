"""The target distribution: each filter against a direct definition."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.decode.sampling import (SamplingParams, apply_repeat_penalty, backend_top_k, greedy_token,
                                     pick_token, sample_from, sample_support, support_of_top, target_probs,
                                     target_support)

EMPTY = np.zeros(0, np.int64)


def _softmax(x):
    z = np.exp(x - x.max())
    return z / z.sum()


def test_greedy_is_one_hot_at_argmax():
    logits = np.array([0.1, 2.0, 1.9, -3.0], np.float32)
    p = target_probs(logits, SamplingParams(temperature=0), EMPTY)
    assert p.tolist() == [0, 1, 0, 0]
    assert greedy_token(logits, SamplingParams(), EMPTY) == 1


def test_plain_temperature_is_softmax():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    assert np.allclose(target_probs(logits, params, EMPTY), _softmax(logits.astype(np.float64) / 0.7))


def test_top_k_keeps_k_largest():
    logits = np.arange(10, dtype=np.float32)
    p = target_probs(logits, SamplingParams(temperature=1, top_k=3, top_p=1, min_p=0), EMPTY)
    assert np.flatnonzero(p).tolist() == [7, 8, 9]
    assert np.isclose(p.sum(), 1)


@pytest.mark.parametrize("vocab", [20, 5000])  # small and large (fast path) vocabularies
def test_top_p_keeps_smallest_prefix_reaching_mass(vocab):
    logits = np.random.default_rng(1).normal(size=vocab).astype(np.float32) * 3
    params = SamplingParams(temperature=1, top_k=0, top_p=0.8, min_p=0)
    p = target_probs(logits, params, EMPTY)
    base = _softmax(logits.astype(np.float64))
    order = np.argsort(-base)
    cut = int(np.searchsorted(np.cumsum(base[order]), 0.8)) + 1
    assert set(np.flatnonzero(p)) == set(order[:cut].tolist())


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.2), EMPTY)
    assert np.flatnonzero(p).tolist() == [0, 1, 2]


def test_repeat_penalty_like_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0], np.float32)
    out = apply_repeat_penalty(logits, np.array([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert logits.tolist() == [2.0, -2.0, 1.0]  # input untouched


def test_sample_from_matches_distribution():
    p = np.array([0.0, 0.2, 0.5, 0.3])
    rng = np.random.default_rng(7)
    draws = np.bincount([sample_from(p, rng) for _ in range(20000)], minlength=4) / 20000
    assert draws[0] == 0 and np.abs(draws - p).max() < 0.02


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=0),
                                    SamplingParams(temperature=0.5, top_k=200, top_p=0.5, min_p=0.0),
                                    SamplingParams(temperature=1.0, top_k=3, repeat_penalty=1.3),
                                    SamplingParams(temperature=0.0)])
def test_the_support_is_the_whole_vector_and_draws_the_same_tokens(params):
    """target_support is target_probs's nonzero entries, ascending; sample_support draws what
    sample_from draws from the same generator state (plain decoding and drafting both sample
    the support, verification reads the vector)."""
    rng = np.random.default_rng(3)
    for _ in range(10):
        logits = (rng.standard_normal(151936) * 4).astype(np.float32)
        recent = rng.integers(0, 151936, 64)
        ids, p = target_support(logits, params, recent)
        full = target_probs(logits, params, recent)
        assert ids.tolist() == np.flatnonzero(full).tolist() and p.tolist() == full[ids].tolist()
        seed = int(rng.integers(1 << 30))
        a, b, c = (np.random.default_rng(seed) for _ in range(3))
        draws = [sample_from(full, a) for _ in range(20)]
        assert draws == [sample_support(ids, p, b) for _ in range(20)]
        assert draws[0] == pick_token(logits, params, list(recent), c)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
                                    SamplingParams(temperature=0.5, top_k=200, top_p=0.5, min_p=0.0),
                                    SamplingParams(temperature=1.0, top_k=3, repeat_penalty=1.3),
                                    SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.1, repeat_last_n=16)])
def test_the_largest_logits_give_the_support_of_the_whole_row(params):
    """A row's backend_top_k(params) largest logits, in any order, give target_support's ids
    and probabilities (a repetition penalty can push recent tokens out of the top-k only)."""
    rng = np.random.default_rng(5)
    k = backend_top_k(params)
    assert k == params.top_k + (params.repeat_last_n if params.repeat_penalty > 1 else 0)
    for trial in range(20):
        logits = (rng.standard_normal(151936) * 4).astype(np.float32)
        recent = rng.integers(0, 151936, 64)
        if trial % 2:  # the recent tokens among the largest, where the penalty moves them
            recent = np.argpartition(-logits, 2 * k)[:min(len(recent), 2 * k)][rng.permutation(min(64, 2 * k))]
        recent = recent[-params.repeat_last_n:] if params.repeat_penalty != 1.0 else np.zeros(0, np.int64)
        top = rng.permutation(np.argpartition(-logits, k - 1)[:k])
        ids, p = support_of_top(top, logits[top], params, recent)
        want_ids, want_p = target_support(logits, params, recent)
        assert ids.tolist() == want_ids.tolist()
        np.testing.assert_allclose(p, want_p, rtol=1e-12, atol=0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=0),
                                    SamplingParams(temperature=0.7, repeat_penalty=0.9)])
def test_no_top_holds_the_support_without_top_k_or_with_a_raising_penalty(params):
    assert backend_top_k(params) == 0


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(min_p=1.0), dict(top_k=-1), dict(repeat_penalty=0)])
def test_invalid_params(kwargs):
    from edgespec.errors import InvalidRequest
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)
