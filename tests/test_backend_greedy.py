"""Greedy picks made on the backend (edgespec.llama.rows) on the real llama.cpp: the same tokens
as the argmax of the logits that come back without them, and no logits copied for the rows
picked. A stock build picks plain decoding's row with llama.cpp's sampler and verifications read
logits; a build with edgespec's output argmax (native/llama_cpp_patches.py) picks every row, the
verifications' too. The engine turns picks on for a target with its output layer on a GPU; the
CPU build runs the same graph, so these tests prove whichever build they run on."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.suffix import SuffixDrafter
from edgespec.errors import BackendError
from edgespec.llama.backend import ContextParams, LlamaContext
from edgespec.llama.rows import OUTPUT_ARGMAX, OUTPUT_TOPK
from edgespec.spec.step import SpeculativeStep

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, iteratively."""\n'
GREEDY = GenerationRequest(max_tokens=48, sampling=SamplingParams())


def _decoders(model, on: bool):
    params = ContextParams(n_ctx=512, n_seq_max=9, n_outputs_max=9, greedy_on_backend=on)
    plain = Decoder(model, KVSequence(LlamaContext(model, params)))
    spec = Decoder(model, KVSequence(LlamaContext(model, params)), SpeculativeStep(SuffixDrafter(), 8))
    return plain, spec


def test_backend_picks_equal_the_logits_argmax_in_plain_and_speculative_decoding(small_model):
    prompt = small_model.tokenize(PROMPT)
    answers = {}
    for on in (False, True):
        plain, spec = _decoders(small_model, on)
        for name, decoder in (("plain", plain), ("spec", spec)):
            for _ in range(2):  # the second request repeats the first: the suffix index drafts it
                done = decoder.generate(prompt, GREEDY)
            answers[name, on] = done.token_ids
            assert decoder.seq.ctx._greedy.attached is (on and (name == "plain" or OUTPUT_ARGMAX))
            assert name == "plain" or done.stats.spec.accepted > 0  # verified drafts, not one-token steps
        for d in (plain, spec):
            d.seq.ctx.close()
    assert answers["plain", True] == answers["plain", False] == answers["spec", False] == answers["spec", True]


def test_picked_rows_have_no_logits_and_are_the_logits_argmax_in_every_sequence(small_model):
    ctx = LlamaContext(small_model, ContextParams(n_ctx=256, n_seq_max=3, n_outputs_max=4, greedy_on_backend=True))
    try:
        tokens = small_model.tokenize(PROMPT)[:8]
        assert ctx.pick_on_backend(True)
        rows = ctx.decode_rows(tokens, range(8), [[0]] * 8, [False] * 7 + [True])
        picked = rows.greedy(7)
        with pytest.raises(BackendError, match="picked on the backend"):
            rows(7)
        ctx.seq_cp(0, 1, 0, 8)
        ctx.seq_cp(0, 2, 0, 8)
        # a tree's rows: the pending token in both paths, one child in each
        tree = ([picked, 5, 6], [8, 9, 9], [[1, 2], [1], [2]], [True] * 3)
        assert ctx.pick_on_backend(True, every_row=True) is OUTPUT_ARGMAX
        if not OUTPUT_ARGMAX:  # the sampler on sequence 0: the tree's rows in 1 and 2 keep their logits
            assert ctx.pick_on_backend(True)
        rows = ctx.decode_rows(*tree)
        if OUTPUT_ARGMAX:  # every row of every sequence is picked, none copied back
            with pytest.raises(BackendError, match="picked on the backend"):
                rows(1)
        else:
            assert all(rows(i).shape == (small_model.n_vocab,) for i in range(3))
        greedy = [rows.greedy(i) for i in range(3)]
        assert not ctx.pick_on_backend(False)
        ctx.seq_rm(1, 8)
        ctx.seq_rm(2, 8)
        rows = ctx.decode_rows(*tree)
        assert greedy == [int(rows(i).argmax()) for i in range(3)]
        ctx.clear()
        rows = ctx.decode_rows(tokens, range(8), [[0]] * 8, [False] * 7 + [True])
        assert int(rows(7).argmax()) == picked  # logits again, the backend's pick their argmax
    finally:
        ctx.close()


def test_only_greedy_requests_without_penalty_let_the_backend_pick(small_model):
    plain, _ = _decoders(small_model, True)
    prompt = small_model.tokenize(PROMPT)
    plain.generate(prompt, GenerationRequest(max_tokens=4, sampling=SamplingParams(repeat_penalty=1.1)))
    assert not plain.seq.ctx._greedy.attached
    plain.generate(prompt, GenerationRequest(max_tokens=4, sampling=SamplingParams(temperature=0.7, seed=3)))
    assert not plain.seq.ctx._greedy.attached
    plain.generate(prompt, GREEDY)
    assert plain.seq.ctx._greedy.attached
    plain.seq.ctx.close()


SAMPLED = [GenerationRequest(max_tokens=48, sampling=SamplingParams(temperature=0.8, seed=7)),
           GenerationRequest(max_tokens=48, sampling=SamplingParams(temperature=1.0, top_k=20, repeat_penalty=1.3,
                                                                   repeat_last_n=16, seed=11))]


@pytest.mark.parametrize("request_", SAMPLED, ids=["sampled", "penalized"])
def test_sampled_decoding_from_the_largest_logits_draws_what_the_whole_rows_draw(small_model, request_):
    """With output top-k (a build with edgespec's patch) sampled rows come back as their
    backend_top_k largest logits; plain and speculative sampling then draw the same tokens from
    the same seed as reading whole rows (a stock build reads whole rows either way)."""
    prompt = small_model.tokenize(PROMPT)
    answers = {}
    for on in (False, True):
        plain, spec = _decoders(small_model, on)
        for name, decoder in (("plain", plain), ("spec", spec)):
            for _ in range(2):
                done = decoder.generate(prompt, request_)
            answers[name, on] = done.token_ids
            top = decoder.seq.ctx._top
            assert (top is not None and top.k > 0) is (on and OUTPUT_TOPK)
            assert name == "plain" or done.stats.spec.drafted > 0
        for d in (plain, spec):
            d.seq.ctx.close()
    assert answers["plain", True] == answers["plain", False]
    assert answers["spec", True] == answers["spec", False]


@pytest.mark.skipif(not OUTPUT_TOPK, reason="a build without edgespec's output top-k")
def test_top_rows_are_the_largest_logits_of_every_row_and_no_logits(small_model):
    params = ContextParams(n_ctx=256, n_seq_max=3, n_outputs_max=4, greedy_on_backend=True)
    on, off = LlamaContext(small_model, params), LlamaContext(small_model, params)
    try:
        tokens = small_model.tokenize(PROMPT)[:8]
        tree = ([tokens[-1], 5, 6], [8, 9, 9], [[1, 2], [1], [2]], [True] * 3)
        assert on.top_on_backend(40) and not off.top_on_backend(0)
        for ctx in (on, off):
            ctx.decode_rows(tokens, range(8), [[0]] * 8, [False] * 8)
            ctx.seq_cp(0, 1, 0, 8)
            ctx.seq_cp(0, 2, 0, 8)
        top, rows = on.decode_rows(*tree), off.decode_rows(*tree)
        for i in range(3):
            ids, logits = top.top(i)
            want = rows(i)
            assert len(set(ids.tolist())) == 40 and (logits == want[ids]).all()
            assert logits.min() >= np.partition(want, -40)[-40]
            assert top.greedy(i) == int(want.argmax())
        with pytest.raises(BackendError, match="picked on the backend"):
            top(0)
        assert on.pick_on_backend(True, every_row=True) and not on.top_on_backend(40)  # argmax wins
    finally:
        on.close()
        off.close()
