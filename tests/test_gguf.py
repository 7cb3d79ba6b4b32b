"""Tests of edgespec.files.gguf: the valid corpus file, every hostile variant, fuzzing, real models."""
from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import time
import tracemalloc
from pathlib import Path

import pytest

import gguf_corpus as corpus
from edgespec.files import gguf_reader as gguf
from edgespec.errors import InvalidGGUF
from edgespec.files.gguf import model_info, read_gguf, tokenizer_fingerprint
from edgespec.files.gguf_structure import GGML_TYPES

CASES = list(corpus.MUTATIONS) + ["directory", "missing", "fifo"]


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return corpus.build_corpus(tmp_path_factory.mktemp("gguf-corpus"))


@pytest.fixture(scope="module")
def valid_path(tmp_path_factory) -> Path:
    return corpus.write_valid(tmp_path_factory.mktemp("gguf-valid") / "valid.gguf")


# ---- the valid file ------------------------------------------------------------------------


def test_valid_file_header(valid_path):
    g = read_gguf(valid_path)
    assert g.path == str(valid_path)
    assert g.version == 3
    assert g.alignment == 64
    assert g.file_size == valid_path.stat().st_size
    assert g.data_offset % 64 == 0


def test_valid_file_metadata(valid_path):
    md = read_gguf(valid_path).metadata
    assert md["general.architecture"] == "llama"
    assert md["general.alignment"] == 64
    assert md["tokenizer.ggml.tokens"] == corpus.VALID_TOKENS
    assert md["tokenizer.ggml.scores"] == [float(-i) for i in range(len(corpus.VALID_TOKENS))]
    assert md["tokenizer.ggml.token_type"][:3] == [3, 3, 1]
    assert md["edgespec.test.u8"] == 200 and md["edgespec.test.i8"] == -3
    assert md["edgespec.test.u16"] == 60000 and md["edgespec.test.i16"] == -30000
    assert md["edgespec.test.i32"] == -70000
    assert md["edgespec.test.u64"] == 2**40 + 1 and md["edgespec.test.i64"] == -(2**40)
    assert md["edgespec.test.f64"] == 0.5 and md["edgespec.test.flag"] is True
    assert md["edgespec.test.empty"] == []
    assert list(md) == [kv.key for kv in corpus.valid_spec().kvs]  # file order is kept


def test_valid_file_tensors(valid_path):
    g = read_gguf(valid_path)
    assert [t.name for t in g.tensors] == ["token_embd.weight", "blk.0.attn_norm.weight",
                                           "output.weight"]
    emb, norm, out = g.tensors
    assert (emb.shape, emb.type_name, emb.n_elements, emb.nbytes) == ((32, 8), "Q8_0", 256, 272)
    assert (norm.shape, norm.type_name, norm.nbytes) == ((32,), "F32", 128)
    assert (out.shape, out.ggml_type, out.nbytes) == ((64, 3), 8, 204)
    assert emb.offset == g.data_offset
    # The offsets are absolute: the bytes there are the tensor's data.
    raw = valid_path.read_bytes()
    assert struct.unpack_from("<32f", raw, norm.offset) == tuple(1.0 + i / 64 for i in range(32))
    assert raw[out.offset:out.offset + out.nbytes] == corpus.valid_spec().tensors[2].data


def test_version_2_is_accepted(tmp_path):
    spec = corpus.valid_spec()
    spec.version = 2
    p = tmp_path / "v2.gguf"
    p.write_bytes(corpus.serialize(spec)[0])
    assert read_gguf(p).version == 2


def test_default_alignment_and_no_tensors(tmp_path):
    spec = corpus.valid_spec()
    spec.kvs = [kv for kv in spec.kvs if kv.key != "general.alignment"]
    spec.alignment = 32
    p = tmp_path / "align32.gguf"
    p.write_bytes(corpus.serialize(spec)[0])
    assert read_gguf(p).alignment == 32
    spec.tensors = []
    p.write_bytes(corpus.serialize(spec)[0])
    g = read_gguf(p)
    assert g.tensors == () and g.data_offset == g.file_size


def test_path_like_and_str(valid_path):
    assert read_gguf(str(valid_path)) == read_gguf(valid_path)


def test_model_info_of_valid_file(valid_path):
    info = model_info(valid_path)
    assert info.architecture == "llama"
    assert info.name == "edgespec corpus model"
    assert info.quantization == "Q8_0"  # from general.file_type 7
    assert info.parameters == 256 + 32 + 192
    assert (info.context_length, info.n_layers, info.embedding_length) == (256, 1, 32)
    assert (info.head_count, info.head_count_kv) == (4, 2)
    assert info.vocab_size == len(corpus.VALID_TOKENS)
    assert info.tokenizer_model == "gpt2"
    assert info.file_size == valid_path.stat().st_size
    d = info.to_dict()
    assert "chat_template" not in d and d["has_chat_template"] is True
    assert json.loads(json.dumps(d)) == d


def test_quantization_falls_back_to_largest_tensor_type(tmp_path):
    spec = corpus.valid_spec()
    spec.kvs = [kv for kv in spec.kvs if kv.key != "general.file_type"]
    p = tmp_path / "noftype.gguf"
    p.write_bytes(corpus.serialize(spec)[0])
    assert model_info(p).quantization == "Q8_0"  # 476 bytes of Q8_0 against 128 of F32


def test_model_info_needs_architecture(tmp_path):
    spec = corpus.valid_spec()
    spec.kvs = [kv for kv in spec.kvs if kv.key != "general.architecture"]
    p = tmp_path / "noarch.gguf"
    p.write_bytes(corpus.serialize(spec)[0])
    read_gguf(p)  # a valid GGUF file ...
    with pytest.raises(InvalidGGUF, match="missing general.architecture"):
        model_info(p)  # ... but not a model


def test_tokenizer_fingerprint_definition(valid_path):
    g = read_gguf(valid_path)
    text = "gpt2\n" + "\0".join(corpus.VALID_TOKENS)
    assert tokenizer_fingerprint(g) == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_tokens_with_invalid_utf8_keep_their_bytes(tmp_path):
    """Byte-level BPE tokens can be partial UTF-8; they must parse and hash by their bytes."""
    spec = corpus.valid_spec()
    raw_tokens = [b"<s>", b"\xe4\xb8", b"\xad", b"ok"]
    next(kv for kv in spec.kvs if kv.key == "tokenizer.ggml.tokens").value = (
        corpus.STRING, raw_tokens)
    p = tmp_path / "bytetokens.gguf"
    p.write_bytes(corpus.serialize(spec)[0])
    g = read_gguf(p)
    toks = g.metadata["tokenizer.ggml.tokens"]
    assert [t.encode("utf-8", "surrogateescape") for t in toks] == raw_tokens
    expected = hashlib.sha256(b"gpt2\n" + b"\0".join(raw_tokens)).hexdigest()[:16]
    assert tokenizer_fingerprint(g) == expected


def test_fingerprint_changes_with_any_token(tmp_path):
    spec = corpus.valid_spec()
    next(kv for kv in spec.kvs if kv.key == "tokenizer.ggml.tokens").value = (
        corpus.STRING, corpus.VALID_TOKENS[:-1] + ["\u2581tha"])
    p = tmp_path / "othertok.gguf"
    p.write_bytes(corpus.serialize(spec)[0])
    assert model_info(p).tokenizer_fingerprint != model_info(
        corpus.write_valid(tmp_path / "v.gguf")).tokenizer_fingerprint


def test_ggml_type_table():
    assert GGML_TYPES[0] == ("F32", 1, 4) and GGML_TYPES[1] == ("F16", 1, 2)
    assert GGML_TYPES[2] == ("Q4_0", 32, 18) and GGML_TYPES[8] == ("Q8_0", 32, 34)
    assert GGML_TYPES[12] == ("Q4_K", 256, 144) and GGML_TYPES[14] == ("Q6_K", 256, 210)
    assert GGML_TYPES[30] == ("BF16", 1, 2) and GGML_TYPES[39] == ("MXFP4", 32, 17)
    for removed in (4, 5, 31, 32, 33, 36, 37, 38):
        assert removed not in GGML_TYPES


# ---- hostile files -------------------------------------------------------------------------


def test_corpus_covers_every_case(corpus_files):
    expected = set(CASES) if hasattr(os, "mkfifo") else set(CASES) - {"fifo"}
    assert set(corpus_files) == expected


@pytest.mark.parametrize("case", CASES)
def test_hostile_file_is_rejected_clearly(corpus_files, case):
    if case not in corpus_files:
        pytest.skip(f"{case} cannot be made on this platform")
    path, expected = corpus_files[case]
    with pytest.raises(InvalidGGUF) as info:
        read_gguf(path)
    err = info.value
    assert err.path == str(path)
    assert str(err).startswith(f"{path}: not a valid GGUF file: ")
    assert expected in err.problem, err.problem
    assert "\n" not in str(err)


@pytest.mark.parametrize("case", CASES)
def test_hostile_file_is_rejected_with_little_memory(corpus_files, case):
    if case not in corpus_files:
        pytest.skip(f"{case} cannot be made on this platform")
    path, _ = corpus_files[case]
    tracemalloc.start()
    try:
        with pytest.raises(InvalidGGUF):
            read_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{case}: peak {peak} bytes"


def test_model_info_rejects_hostile_file(corpus_files):
    path, _ = corpus_files["huge_tensor_count"]
    with pytest.raises(InvalidGGUF, match="tensor count"):
        model_info(path)


def test_allocation_caps(valid_path, monkeypatch):
    """Metadata decoding is capped whatever the file size, so a big file cannot cost GBs."""
    monkeypatch.setattr(gguf, "MAX_STRING_LENGTH", 20)
    with pytest.raises(InvalidGGUF, match="more than the 20 bytes allowed"):
        read_gguf(valid_path)
    monkeypatch.undo()
    monkeypatch.setattr(gguf, "MAX_ARRAY_ELEMENTS_TOTAL", 10)
    with pytest.raises(InvalidGGUF, match="more than the 10 array elements allowed"):
        read_gguf(valid_path)


# ---- fuzzing -------------------------------------------------------------------------------


def _check_parse_or_invalid(path: Path) -> None:
    """The only acceptable outcomes: a parse, or InvalidGGUF with a one-line message."""
    try:
        read_gguf(path)
    except InvalidGGUF as e:
        assert "\n" not in str(e)


_EXTREMES = [0, 1, 0xFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**63, 2**64 - 1]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One random corruption: flipped bytes, a truncation, or an extreme integer written."""
    kind = rng.randrange(3)
    if kind == 0:
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == 1:
        return data[:rng.randrange(len(data))]
    pos = rng.randrange(len(data) - 8)
    return data[:pos] + struct.pack("<Q", rng.choice(_EXTREMES)) + data[pos + 8:]


def test_seeded_fuzz_only_invalid_gguf(tmp_path):
    data, _ = corpus.serialize(corpus.valid_spec())
    rng = random.Random(20240531)
    path = tmp_path / "fuzz.gguf"
    start = time.perf_counter()
    outcomes = {"ok": 0, "invalid": 0}
    for _ in range(3000):
        path.write_bytes(_mutate(rng, data))
        try:
            read_gguf(path)
            outcomes["ok"] += 1
        except InvalidGGUF as e:
            assert "\n" not in str(e)
            outcomes["invalid"] += 1
    assert outcomes["invalid"] > 1000  # the mutations do hit the checks
    assert time.perf_counter() - start < 60


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # hypothesis is a test extra; the seeded fuzz above covers the same ground
    given = None

if given is not None:
    _VALID = corpus.serialize(corpus.valid_spec())[0]

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(edits=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.binary(min_size=1, max_size=8)),
                          min_size=1, max_size=4),
           cut=st.integers(1, len(_VALID)))
    def test_hypothesis_fuzz_only_invalid_gguf(tmp_path, edits, cut):
        buf = bytearray(_VALID)
        for pos, patch in edits:
            buf[pos:pos + len(patch)] = patch
        path = tmp_path / "hyp.gguf"
        path.write_bytes(bytes(buf[:cut]))
        _check_parse_or_invalid(path)


# ---- agreement with the reference gguf-py reader (a test extra) ----------------------------


def test_agrees_with_gguf_py_on_valid_file(valid_path):
    gguf_py = pytest.importorskip("gguf", reason="gguf-py (test extra) not installed")
    ref = gguf_py.GGUFReader(str(valid_path))
    g = read_gguf(valid_path)
    assert ref.data_offset == g.data_offset
    for a, b in zip(ref.tensors, g.tensors, strict=True):
        assert (a.name, tuple(int(x) for x in a.shape), int(a.tensor_type)) == (
            b.name, b.shape, b.ggml_type)
        assert (a.data_offset, int(a.n_bytes)) == (b.offset, b.nbytes)


def test_reads_file_written_by_gguf_py(tmp_path):
    gguf_py = pytest.importorskip("gguf", reason="gguf-py (test extra) not installed")
    np = pytest.importorskip("numpy")
    p = tmp_path / "gguf-py.gguf"
    w = gguf_py.GGUFWriter(str(p), "llama")
    w.add_uint32("llama.context_length", 64)
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("t1", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("t2", np.ones((5,), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = read_gguf(p)
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"]
    assert [(t.name, t.shape, t.type_name) for t in g.tensors] == [
        ("t1", (4, 3), "F32"), ("t2", (5,), "F16")]


def _llama_cpp_gguf_accepts(path: Path) -> bool:
    """Ask llama.cpp's own GGUF parser (gguf_init_from_file, metadata only) about a file."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")  # locate the bundled libs without loading them
    lib_path = Path(spec.origin).parent / "lib" / "libggml-base.so" if spec else None
    if lib_path is None or not lib_path.exists():
        pytest.skip("llama-cpp-python with a bundled libggml-base.so is not installed")

    class InitParams(ctypes.Structure):  # struct gguf_init_params
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]

    lib = ctypes.CDLL(str(lib_path))
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, InitParams]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = lib.gguf_init_from_file(str(path).encode(), InitParams(True, None))
    if ctx:
        lib.gguf_free(ctx)
    return bool(ctx)


def test_llama_cpp_accepts_the_valid_corpus_file(valid_path):
    """The corpus writer and this reader agree with llama.cpp on what a valid file is."""
    assert _llama_cpp_gguf_accepts(valid_path)


# ---- real models ---------------------------------------------------------------------------

# store name -> (architecture, quantization, vocab size, layers)
REAL_MODELS = {
    "qwen2.5-coder-1.5b": ("qwen2", "Q4_K_M", 151936, 28),
    "qwen2.5-coder-0.5b": ("qwen2", "Q4_K_M", 151936, 24),
    "smollm2-135m": ("llama", "Q4_1", 49152, 30),
    "gemma3-270m": ("gemma3", "Q4_K_M", 262144, 18),
}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_model_info(name, model_path, store):
    arch, quant, vocab, layers = REAL_MODELS[name]
    path = model_path(name)
    info = model_info(path)
    assert (info.architecture, info.quantization, info.vocab_size, info.n_layers) == (
        arch, quant, vocab, layers)
    # The fingerprint pinned in the manifest is the one computed from the file.
    assert info.tokenizer_fingerprint == store.manifests()[name].tokenizer_fingerprint
    assert info.file_size == path.stat().st_size
    assert info.parameters > 100_000_000
    g = read_gguf(path)
    last = max(g.tensors, key=lambda t: t.offset)
    assert last.offset + last.nbytes <= g.file_size
    if name.startswith("qwen"):
        assert len(g.metadata["tokenizer.ggml.tokens"]) == 151936


def test_real_model_fingerprints_compare(model_path):
    fps = {n: model_info(model_path(n)).tokenizer_fingerprint for n in REAL_MODELS}
    assert fps["qwen2.5-coder-1.5b"] == fps["qwen2.5-coder-0.5b"]
    assert len({fps["qwen2.5-coder-1.5b"], fps["smollm2-135m"], fps["gemma3-270m"]}) == 3
