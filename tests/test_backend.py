"""The llama.cpp backend with a real model: batches, sequences, KV edits, tokenizer."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.llama.backend import ContextParams, LlamaContext
from edgespec.errors import InvalidRequest

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _one_by_one(ctx, tokens, start=0, seq=0):
    return np.array([ctx.decode([t], [start + i], [[seq]], [True])[0] for i, t in enumerate(tokens)])


def test_flagged_rows_only(small_model, small_ctx):
    toks = small_model.tokenize(TEXT)
    flags = [i % 3 == 0 for i in range(len(toks))]
    out = small_ctx.decode(toks, range(len(toks)), [[0]] * len(toks), flags)
    assert out.shape == (sum(flags), small_model.n_vocab)
    small_ctx.clear()
    ref = _one_by_one(small_ctx, toks)
    # Batched and one-token decoding agree up to llama.cpp's batch numerics.
    assert np.abs(out - ref[np.array(flags)]).max() < 0.1


def test_token_in_two_sequences_is_attended_by_both(small_model, small_ctx):
    toks = small_model.tokenize(TEXT)
    prefix, a, b = toks[:-1], toks[-1], small_model.tokenize(" cat", add_special=False)[0]
    n = len(prefix)
    # The prefix is decoded once, shared by sequences 1 and 2; each branch adds its own token.
    small_ctx.decode(prefix, range(n), [[1, 2]] * n, [False] * n)
    both = small_ctx.decode([a, b], [n, n], [[1], [2]], [True, True])
    fresh = LlamaContext(small_model, ContextParams(n_ctx=256))
    try:
        ref_a = fresh.decode(prefix + [a], range(n + 1), [[0]] * (n + 1), [False] * n + [True])[0]
        fresh.clear()
        ref_b = fresh.decode(prefix + [b], range(n + 1), [[0]] * (n + 1), [False] * n + [True])[0]
    finally:
        fresh.close()
    assert np.abs(both[0] - ref_a).max() < 0.1
    assert np.abs(both[1] - ref_b).max() < 0.1
    # The branches really differ: each saw its own last token, not the other's.
    assert np.abs(both[0] - both[1]).max() > 1.0


def test_kv_removal_then_continue_equals_fresh_decode(small_model, small_ctx):
    toks = small_model.tokenize(TEXT)
    other = small_model.tokenize(" and then something entirely different happened", add_special=False)
    keep = len(toks) - 4
    small_ctx.decode(toks, range(len(toks)), [[0]] * len(toks), [False] * len(toks))
    small_ctx.seq_rm(0, keep, -1)
    assert small_ctx.seq_pos_max(0) == keep - 1
    cont = small_ctx.decode(other, range(keep, keep + len(other)), [[0]] * len(other), [True] * len(other))
    small_ctx.clear()
    seq = toks[:keep] + other
    fresh = small_ctx.decode(seq, range(len(seq)), [[0]] * len(seq),
                             [False] * keep + [True] * len(other))
    assert np.abs(cont - fresh).max() < 0.1
    assert (cont.argmax(-1) == fresh.argmax(-1)).all()


def test_seq_copy_and_keep(small_model, small_ctx):
    toks = small_model.tokenize(TEXT)
    n = len(toks)
    small_ctx.decode(toks, range(n), [[0]] * n, [False] * n)
    small_ctx.seq_cp(0, 3, 0, n)
    assert small_ctx.seq_pos_max(3) == n - 1
    small_ctx.seq_keep(3)
    assert small_ctx.seq_pos_max(0) == -1
    assert small_ctx.seq_pos_max(3) == n - 1


@pytest.mark.parametrize("bad, message", [
    (dict(tokens=[], positions=[], seq_ids=[], logits=[]), "empty batch"),
    (dict(tokens=[1, 2], positions=[0], seq_ids=[[0], [0]], logits=[True, True]), "same length"),
    (dict(tokens=[10 ** 7], positions=[0], seq_ids=[[0]], logits=[True]), "out of range"),
    (dict(tokens=[1], positions=[0], seq_ids=[[9]], logits=[True]), "sequence ids"),
    (dict(tokens=[1], positions=[10 ** 6], seq_ids=[[0]], logits=[True]), "outside the context"),
])
def test_bad_batches_are_refused_before_llama_cpp(small_ctx, bad, message):
    with pytest.raises(InvalidRequest, match=message):
        small_ctx.decode(**bad)


def test_tokenize_roundtrip_and_special_tokens(small_model):
    text = "Hello, world! héllo 世界"
    toks = small_model.tokenize(text, add_special=False)
    assert b"".join(small_model.token_piece(t) for t in toks).decode() == text
    im_start = small_model.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1
    assert small_model.token_piece(im_start[0]) == b""  # control tokens never print


def test_memory_report(small_ctx, small_model):
    report = small_ctx.memory_report()
    assert report["weights"] == small_model.weights_bytes > 50_000_000
    assert report["kv_cache"] > 0


def test_a_context_sized_for_its_verifications_refuses_more_rows(small_model):
    """n_outputs_max bounds the rows one decode returns; a batch asking more is refused before
    llama.cpp, whose output_reserve asserts it (an abort of the process)."""
    toks = small_model.tokenize(TEXT)[:6]
    ctx = LlamaContext(small_model, ContextParams(n_ctx=256, n_outputs_max=4))
    try:
        assert ctx.n_outputs_max == 4
        assert ctx.memory_report()["logits_buffer"] == 4 * 4 * small_model.n_vocab
        with pytest.raises(InvalidRequest, match="5 logits rows; the context allows 4"):
            ctx.decode(toks, range(6), [[0]] * 6, [False] + [True] * 5)
        assert ctx.seq_pos_max(0) == -1  # refused before anything was decoded
        out = ctx.decode(toks, range(6), [[0]] * 6, [False, False] + [True] * 4)
        assert out.shape == (4, small_model.n_vocab) and np.isfinite(out).all()
    finally:
        ctx.close()


def test_a_batch_names_its_first_bad_row():
    from edgespec.llama.batch import Batch
    b = Batch(8, 3)
    with pytest.raises(InvalidRequest, match="row 2: sequence ids must be in"):
        b.fill([1, 2, 3], [0, 1, 2], [[0], [0, 1], [0, 3]], [True] * 3, n_vocab=10, n_ctx=16)
    with pytest.raises(InvalidRequest, match="row 1: sequence ids"):
        b.fill([1, 2], [0, 1], [[0], []], [True] * 2, n_vocab=10, n_ctx=16)
    with pytest.raises(InvalidRequest, match="token id -1 out of range"):
        b.fill([1, -1], [0, 1], [[0], [0]], [True] * 2, n_vocab=10, n_ctx=16)
    with pytest.raises(InvalidRequest, match=f"token id {2 ** 40} out of range"):
        b.fill([1, 2 ** 40], [0, 1], [[0], [0]], [True] * 2, n_vocab=10, n_ctx=16)
    assert b.fill([4, 5, 6], [3, 4, 4], [[0], [0, 1], [2]], [False, True, True], n_vocab=10, n_ctx=16) == 2
    assert b.n_seq_id[:3].tolist() == [1, 2, 1]
    assert [b.seq_id[i, :b.n_seq_id[i]].tolist() for i in range(3)] == [[0], [0, 1], [2]]
    # llama.cpp reads the seq ids through the struct's row pointers
    assert [b.struct.seq_id[1][j] for j in range(2)] == [0, 1] and b.struct.token[2] == 6


def test_batch_sizes_padded_to_the_kept_graphs():
    from edgespec.llama.backend import padded_size
    from edgespec.memory.placements import GRAPH_SIZES
    assert [padded_size(n, GRAPH_SIZES) for n in (1, 2, 3, 4, 6, 9, 10, 18, 26, 34, 60, 65)] == \
        [1, 2, 3, 5, 9, 9, 17, 25, 33, 41, 65, 65]
    assert padded_size(66, GRAPH_SIZES) == 66 and padded_size(7, ()) == 7  # a prompt chunk; no kept graphs


def test_a_batch_is_padded_only_in_one_sequence_and_inside_the_context():
    from edgespec.llama.batch import Batch
    b = Batch(8, 3)
    b.fill([4, 5, 6], [3, 4, 5], [[1]] * 3, [True] * 3, n_vocab=10, n_ctx=16)
    assert b.pad(3, 4, n_ctx=16) == (1, 6)
    assert b.token[:4].tolist() == [4, 5, 6, 6] and b.pos[:4].tolist() == [3, 4, 5, 6]
    assert b.seq_id[3, 0] == 1 and b.n_seq_id[3] == 1 and b.logits[3] == 1
    b.fill([4, 5, 6], [13, 14, 15], [[1]] * 3, [True] * 3, n_vocab=10, n_ctx=16)
    assert b.pad(3, 4, n_ctx=16) is None  # position 16 is outside the context
    b.fill([4, 5, 6], [3, 4, 4], [[0], [0], [1]], [True] * 3, n_vocab=10, n_ctx=16)
    assert b.pad(3, 4, n_ctx=16) is None  # two sequences (a draft tree)
    b.fill([4, 5], [3, 4], [[0], [0, 1]], [True] * 2, n_vocab=10, n_ctx=16)
    assert b.pad(2, 4, n_ctx=16) is None


SIZES = (1, 2, 3, 5, 9)


@pytest.mark.parametrize("n", [3, 4, 6])
def test_a_padded_verification_reads_as_one_unpadded_and_leaves_only_its_cells(small_model, n, monkeypatch):
    """With graphs kept by size, a batch of n tokens is decoded as the next kept size; the caller
    sees its own n rows (the pad's are not readable) and the cache holds exactly its tokens, so
    the next one-token decode at the following position is accepted."""
    monkeypatch.delenv("LLAMA_GRAPH_SIZES", raising=False)
    toks = small_model.tokenize(TEXT)
    head, batch = toks[:-n], toks[-n:]
    contexts = [LlamaContext(small_model, ContextParams(n_ctx=256, graph_sizes=k)) for k in ((), SIZES)]
    try:
        assert [c.graph_sizes for c in contexts] == [(), SIZES]
        outs = []
        for ctx in contexts:
            ctx.decode(head, range(len(head)), [[0]] * len(head), [False] * len(head))
            rows = ctx.decode_rows(batch, range(len(head), len(toks)), [[0]] * n, [True] * n)
            outs.append(np.array([rows(i) for i in range(n)]))
            with pytest.raises(IndexError):
                rows(n)
            assert ctx.seq_pos_max(0) == len(toks) - 1
            outs.append(ctx.decode([toks[0]], [len(toks)], [[0]], [True]))
        assert (outs[0].argmax(-1) == outs[2].argmax(-1)).all()
        assert np.abs(outs[0] - outs[2]).max() < 0.1  # llama.cpp's batch numerics, as above
        assert np.abs(outs[1] - outs[3]).max() < 0.1
    finally:
        for c in contexts:
            c.close()


def test_the_environment_sets_the_kept_sizes(small_model, monkeypatch):
    import os
    from edgespec.llama.backend import graph_sizes
    monkeypatch.setenv("LLAMA_GRAPH_SIZES", "0")
    ctx = LlamaContext(small_model, ContextParams(n_ctx=64, graph_sizes=SIZES))
    try:
        assert ctx.graph_sizes == ()
    finally:
        ctx.close()
    monkeypatch.setenv("LLAMA_GRAPH_SIZES", "9, 1,3")
    assert graph_sizes(SIZES) == (1, 3, 9)
    monkeypatch.setenv("LLAMA_GRAPH_SIZES", "1,two")
    with pytest.raises(InvalidRequest, match="comma list"):
        graph_sizes(())
    monkeypatch.delenv("LLAMA_GRAPH_SIZES")
    ctx = LlamaContext(small_model, ContextParams(n_ctx=64, graph_sizes=SIZES))
    try:
        assert ctx.graph_sizes == SIZES and "LLAMA_GRAPH_SIZES" not in os.environ  # set while it was created
    finally:
        ctx.close()


def test_a_batch_without_room_for_its_pad_is_decoded_as_asked(small_model, monkeypatch):
    monkeypatch.delenv("LLAMA_GRAPH_SIZES", raising=False)
    ctx = LlamaContext(small_model, ContextParams(n_ctx=256, n_seq_max=2, graph_sizes=SIZES))
    try:
        filler = small_model.tokenize(TEXT)[:5] * 50  # 250 of the 256 cells, in sequence 1
        ctx.decode(filler, range(250), [[1]] * 250, [False] * 250)
        toks = small_model.tokenize(TEXT)[:6]  # 6 tokens padded to 9 need 9 cells; 6 are left
        out = ctx.decode(toks, range(6), [[0]] * 6, [True] * 6)
        assert out.shape == (6, small_model.n_vocab) and ctx.seq_pos_max(0) == 5
    finally:
        ctx.close()
