"""Greedy near-tie re-checks, on the exact fake: rows whose top-2 gap is small are decided from
their token decoded alone, and the output stays exactly plain greedy's."""
from __future__ import annotations

import numpy as np

from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.suffix import SuffixDrafter
from edgespec.spec.step import SpeculativeStep
from fake_model import FakeContext, FakeModel

TARGET = FakeModel(n_vocab=96, seed=0)
GREEDY = GenerationRequest(max_tokens=96, sampling=SamplingParams(temperature=0.0))


def decoder(recheck_gap: float | None) -> Decoder:
    ctx = FakeContext(TARGET, n_ctx=1024, n_batch=64, n_seq_max=9)
    step = None if recheck_gap is None else SpeculativeStep(SuffixDrafter(), 8, recheck_gap=recheck_gap)
    return Decoder(TARGET, KVSequence(ctx), step)


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[2] + list(rng.integers(3, 96, size=int(rng.integers(8, 40)))) * 2 for _ in range(n)]


def test_rechecks_keep_greedy_exact():
    plain, off = decoder(None), decoder(0.0)
    gap = float(np.median([_gaps(TARGET, p) for p in _prompts(4)]))  # half the rows are "near-ties"
    on = decoder(gap)
    rechecks = 0
    for prompt in _prompts(8):
        want = plain.generate(prompt, GREEDY).token_ids
        got_off, got_on = off.generate(prompt, GREEDY), on.generate(prompt, GREEDY)
        assert got_off.token_ids == want and got_on.token_ids == want
        assert got_off.stats.spec.rechecks == 0
        rechecks += got_on.stats.spec.rechecks
        assert list(on.seq.tokens) == list(prompt) + list(want[:-1])  # the cache mirrors the output
    assert rechecks > 10


def test_when_every_row_is_a_near_tie_each_step_is_a_plain_decode():
    plain, always = decoder(None), decoder(float("inf"))
    for prompt in _prompts(4):
        got = always.generate(prompt, GREEDY)
        assert got.token_ids == plain.generate(prompt, GREEDY).token_ids
        spec = got.stats.spec
        # Every step that drafted re-checked its first row; steps without a draft decoded the
        # pending token alone already.
        assert spec.drafted > 0 and spec.accepted == 0 and 0 < spec.rechecks < spec.steps


def test_a_step_without_a_draft_is_never_rechecked():
    from edgespec.drafters.none import NoDrafter

    ctx = FakeContext(TARGET, n_ctx=1024, n_batch=64, n_seq_max=9)
    never = Decoder(TARGET, KVSequence(ctx), SpeculativeStep(NoDrafter(), 8, recheck_gap=float("inf")))
    prompt = _prompts(1)[0]
    got = never.generate(prompt, GREEDY)
    assert got.token_ids == decoder(None).generate(prompt, GREEDY).token_ids
    assert got.stats.spec.steps > 0 and got.stats.spec.rechecks == 0


def _gaps(model: FakeModel, prompt: list[int]) -> float:
    """The median top-2 gap of the fake's greedy continuation rows."""
    tokens, gaps = list(prompt), []
    for _ in range(32):
        row = np.sort(model.logits(tokens))
        gaps.append(row[-1] - row[-2])
        tokens.append(int(np.argmax(model.logits(tokens))))
    return float(np.median(gaps))
