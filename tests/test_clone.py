"""Shape clones: valid GGUF, SRC's tokenizer, scaled shapes, finite logits, header-only round trip."""
from __future__ import annotations

import gguf_corpus
import numpy as np
import pytest
from conftest import DRAFTER, TARGET

from edgespec.errors import CloneError, InvalidGGUF
from edgespec.files import clone as clone_mod
from edgespec.files.clone import CloneShape, write_clone
from edgespec.files.gguf import read_gguf, read_gguf_header, tokenizer_fingerprint
from edgespec.files.gguf_structure import GGML_TYPES

# A reduced Qwen2.5-0.5B: two blocks, narrow (rows stay multiples of every block size), so
# that writing and decoding take well under a second.  About 75 MB, most of it the
# 152k-token embedding and output matrices.
SMALL = CloneShape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2)
QWEN_7B = CloneShape(layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4)


@pytest.fixture(scope="module")
def drafter_path(model_path):
    return model_path(DRAFTER)


@pytest.fixture(scope="module")
def small_clone(drafter_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("clone") / "small.gguf"
    write_clone(drafter_path, out, SMALL, seed=7)
    return out


def test_clone_is_valid_with_the_source_tokenizer(drafter_path, small_clone):
    src, g = read_gguf(drafter_path), read_gguf(small_clone)
    assert tokenizer_fingerprint(g) == tokenizer_fingerprint(src)
    md = g.metadata
    assert (md["qwen2.block_count"], md["qwen2.embedding_length"], md["qwen2.feed_forward_length"],
            md["qwen2.attention.head_count"], md["qwen2.attention.head_count_kv"]) == (2, 256, 512, 4, 2)
    assert md["edgespec.clone.of"] == src.metadata["general.name"]
    shape_keys = {f"qwen2.{k}" for k in clone_mod._SHAPE_KEYS.values()}
    for key, value in src.metadata.items():
        if key not in shape_keys:
            assert md[key] == value, key
    by_name = {t.name: t for t in g.tensors}
    assert by_name["blk.1.attn_k.weight"].shape == (256, 128)  # 2 kv heads x head dim 64
    assert by_name["blk.0.ffn_down.weight"].shape == (512, 256)
    assert by_name["token_embd.weight"].shape == (256, 151936)
    # Block i takes the types of SRC's block i * 24 // 2 (quantizers vary types with depth).
    src_types = {t.name.replace("blk.12.", "blk.1."): t.ggml_type for t in src.tensors
                 if not t.name.startswith("blk.") or t.name.startswith(("blk.0.", "blk.12."))}
    assert {n: t.ggml_type for n, t in by_name.items()} == src_types


def test_clone_decodes_finite_logits_in_llama_cpp(small_clone):
    from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel

    model = LlamaModel(small_clone)
    ctx = LlamaContext(model, ContextParams(n_ctx=128, n_batch=32, n_threads=1))
    try:
        tokens = model.tokenize("def add(a, b):")
        logits = ctx.decode(tokens, range(len(tokens)), [[0]] * len(tokens), [True] * len(tokens))
        assert np.isfinite(logits).all() and 0 < logits.std() < 100
        pos, token = len(tokens), int(logits[-1].argmax())
        for _ in range(4):  # greedy decoding, one token at a time
            row = ctx.decode([token], [pos], [[0]], [True])[0]
            assert np.isfinite(row).all()
            pos, token = pos + 1, int(row.argmax())
    finally:
        ctx.close()
        model.close()


def test_header_only_round_trip(drafter_path, small_clone, tmp_path):
    header = tmp_path / "drafter.hdr"
    result = write_clone(drafter_path, header, header_only=True)
    assert result.header_only and result.file_size < 8 << 20
    with pytest.raises(InvalidGGUF):  # no tensor data: llama.cpp must never be given it
        read_gguf(header)
    def infos(path):
        return {t.name: (t.shape, t.ggml_type, t.nbytes) for t in read_gguf_header(path).tensors}
    assert infos(header) == infos(drafter_path)
    again = tmp_path / "again.gguf"
    write_clone(header, again, SMALL, seed=7)
    assert again.read_bytes() == small_clone.read_bytes()


def test_7b_shape_from_the_1_5b_header(model_path, tmp_path):
    out = tmp_path / "qwen7b.hdr"
    result = write_clone(model_path(TARGET), out, QWEN_7B, header_only=True)
    h = read_gguf_header(out)
    by_name = {t.name: t for t in h.tensors}
    assert len([n for n in by_name if n.endswith(".attn_q.weight")]) == 28
    assert by_name["blk.27.attn_k.weight"].shape == (3584, 512)
    assert by_name["blk.27.ffn_down.weight"].shape == (18944, 3584)
    assert by_name["output.weight"].shape == (3584, 151936)
    # The real Qwen2.5-7B-Instruct Q4_K_M holds 4.68 GB of tensor data.
    assert 4.5e9 < result.data_bytes < 4.8e9
    assert h.metadata["qwen2.attention.head_count_kv"] == 4


@pytest.mark.parametrize("type_name", sorted(clone_mod._BLOCK_SCALES))
def test_random_blocks_dequantize_to_small_finite_weights(type_name):
    gguf = pytest.importorskip("gguf")
    type_id = next(i for i, spec in GGML_TYPES.items() if spec[0] == type_name)
    _, _, type_size = GGML_TYPES[type_id]
    data = clone_mod._block_chunk(np.random.default_rng(0), type_name, 2048, type_size)
    w = gguf.quants.dequantize(np.frombuffer(data, dtype=np.uint8),
                               gguf.GGMLQuantizationType(type_id))
    assert np.isfinite(w).all()
    assert 0.01 < float(w.std()) < 0.04 and abs(float(w.mean())) < 0.01


@pytest.mark.parametrize("shape, problem", [
    (CloneShape(layers=0), "--layers must be a positive integer"),
    (CloneShape(hidden=1000), "not a multiple of the head dim"),
    (CloneShape(hidden=896, heads=7), "must equal heads"),
    (CloneShape(hidden=832), "must be a multiple of kv heads"),
    (CloneShape(ffn=4000), "multiple of 256"),  # Q6_K ffn_down rows
])
def test_bad_shapes_are_refused(drafter_path, tmp_path, shape, problem):
    out = tmp_path / "bad.gguf"
    with pytest.raises(CloneError, match=problem):
        write_clone(drafter_path, out, shape)
    assert not out.exists() and not (tmp_path / "bad.gguf.part").exists()


def test_unknown_tensor_roles_are_refused_for_width_changes(tmp_path):
    spec = gguf_corpus.valid_spec()  # its output.weight is 64 x 3, not hidden x vocab
    spec.kvs.append(gguf_corpus.KV("llama.feed_forward_length", gguf_corpus.U32, 64))
    src = tmp_path / "corpus.gguf"
    src.write_bytes(gguf_corpus.serialize(spec)[0])
    write_clone(src, tmp_path / "same.gguf")  # same shape: nothing to understand
    read_gguf(tmp_path / "same.gguf")
    with pytest.raises(CloneError, match="does not have the expected"):
        write_clone(src, tmp_path / "wide.gguf", CloneShape(hidden=64, heads=8))
