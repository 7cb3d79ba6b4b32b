"""GGUF -> ONNX conversion: exact weights, store placement, idempotence, refusals, CLI.

The reference for every weight is the `gguf` package's own dequantization (gguf.quants), read
from the same file; the graph's values are recomputed from its initializers with onnxruntime's
documented MatMulNBits / GatherBlockQuantized formula, not with our converter's code.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
from gguf.quants import dequantize as gguf_dequantize
from onnx import numpy_helper

from edgespec.errors import InvalidRequest, UnsupportedModel
from edgespec.files.gguf import read_gguf, tokenizer_fingerprint
from edgespec.files.store import ModelStore
from edgespec.onnx import graph as graph_mod
from edgespec.onnx.blocks import DECODERS, decode, dequantize
from edgespec.onnx.convert import convert, onnx_dir_for, read_meta

DRAFTER = "qwen2.5-coder-0.5b"
GEMMA = "gemma3-270m"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def source(model_path) -> Path:
    return Path(model_path(DRAFTER))


@pytest.fixture(scope="module")
def converted(onnx_exact):
    """The session's exact conversion (conftest), in the session's store."""
    return onnx_exact


class Graph:
    """Initializers and node attributes of a converted model, read lazily from its files."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
        self.inits = {t.name: t for t in self.model.graph.initializer}
        self.consumer = {n.input[1]: n for n in self.model.graph.node if len(n.input) > 1}

    def array(self, name: str):
        t = self.inits.get(name)
        return None if t is None else numpy_helper.to_array(t, base_dir=str(self.dir))

    def linear_values(self, name: str) -> np.ndarray:
        """[n, k] float32 weights of MatMulNBits ``name`` (+ its offsets), ORT's formula."""
        node = self.consumer[f"{name}.q"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
        b = self.array(f"{name}.q")
        q = np.stack([b & 15, b >> 4], -1).reshape(n, -1, block) if bits == 4 else b.reshape(n, -1, block)
        nb = q.shape[1]
        zeros = self.array(f"{name}.zeros")
        if zeros is None:
            z = np.full((n, nb), 1 << (bits - 1), np.float32)
        elif bits == 4:
            z = np.stack([zeros & 15, zeros >> 4], -1).reshape(n, -1)[:, :nb].astype(np.float32)
        else:
            z = zeros.reshape(n, nb).astype(np.float32)
        w = (q.astype(np.float32) - z[..., None]) * self.array(f"{name}.scales").reshape(n, nb)[..., None]
        offsets = self.array(f"{name}.offsets")  # stored transposed: [nb, n]
        if offsets is not None:
            w = w + offsets.T[..., None]
        return w.reshape(n, k)


class Reference:
    """Tensors of the source GGUF dequantized by gguf.quants (gguf's own reader parses the
    whole vocabulary, ~15 s: the bytes are located with our validated header instead)."""

    def __init__(self, path: Path):
        self.tensors = {t.name: t for t in read_gguf(path).tensors}
        self.data = np.memmap(path, np.uint8, mode="r")

    def __call__(self, name: str, rows=None) -> np.ndarray:
        t = self.tensors[name]
        raw = self.data[t.offset:t.offset + t.nbytes].reshape(t.n_elements // t.shape[0], -1)
        raw = raw if rows is None else raw[rows]
        kind = gguf.GGMLQuantizationType[t.type_name]
        return gguf_dequantize(np.asarray(raw), kind).astype(np.float32).reshape(-1, t.shape[0])


@pytest.fixture(scope="module")
def reader(source) -> Reference:
    return Reference(source)


@pytest.mark.parametrize("layer", [0, 2])  # layer 0: Q5_0, Q8_0, Q6_K; layer 2: Q4_K (offsets)
def test_layer_weights_are_the_gguf_dequantized_weights(converted, reader, layer):
    _, directory = converted
    graph, g = Graph(directory), reader
    p = f"blk.{layer}."
    qkv = np.concatenate([g(f"{p}attn_{x}.weight") for x in "qkv"])
    gate_up = np.concatenate([g(f"{p}ffn_{x}.weight") for x in ("gate", "up")])
    for name, expected in ((f"{p}attn_qkv", qkv), (f"{p}ffn_gate_up", gate_up),
                           (f"{p}attn_output", g(f"{p}attn_output.weight")),
                           (f"{p}ffn_down", g(f"{p}ffn_down.weight"))):
        assert np.array_equal(graph.linear_values(name), expected), name
    bias = np.concatenate([g(f"{p}attn_{x}.bias").reshape(-1) for x in "qkv"])
    assert np.array_equal(graph.array(f"{p}attn_qkv.bias"), bias)
    assert np.array_equal(graph.array(f"{p}attn_norm.weight"), g(f"{p}attn_norm.weight").reshape(-1))


def test_embedding_and_output_are_exact(converted, reader):
    _, directory = converted
    graph, g = Graph(directory), reader
    assert np.array_equal(graph.linear_values("output"), g("output.weight"))
    q, scales = graph.array("embed.q"), graph.array("embed.scales")  # GatherBlockQuantized, 8 bits
    rows = np.array([0, 1, 151643, 100000])
    block = q.shape[1] // scales.shape[1]
    values = (q[rows].astype(np.float32).reshape(len(rows), -1, block) - 128) * scales[rows][..., None]
    assert np.array_equal(values.reshape(len(rows), -1), g("token_embd.weight", rows))


# Byte offsets of the fp16 scale fields per format: random bytes there could be inf/NaN.
_F16_FIELDS = {"Q8_0": [0], "Q5_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.mark.parametrize("fmt", sorted(DECODERS))
def test_every_block_format_matches_gguf_on_random_blocks(fmt):
    per_block, size, _ = DECODERS[fmt]
    rng = np.random.default_rng(7)
    n, k = 5, 1024
    raw = rng.integers(0, 256, (n, k // per_block, size), dtype=np.uint8)
    for at in _F16_FIELDS[fmt]:
        half = rng.uniform(-0.2, 0.2, (n, k // per_block)).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8).reshape(n, k // per_block, 2)
    raw = raw.reshape(n, -1)
    expected = gguf_dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(n, k)
    assert np.array_equal(dequantize(decode(fmt, raw, n, k)), expected)


def test_an_unknown_block_format_is_refused():
    with pytest.raises(UnsupportedModel, match="IQ2_XS cannot be converted exactly"):
        decode("IQ2_XS", np.zeros(74, np.uint8), 1, 256)


def test_meta_carries_the_source_fingerprint(converted, source):
    store, directory = converted
    meta = read_meta(directory)
    assert directory == onnx_dir_for(store, source, "exact")
    assert meta["bits"] == "exact" and meta["shape"]["n_layer"] == 24
    assert meta["source"]["tokenizer_fingerprint"] == tokenizer_fingerprint(read_gguf(source))


def test_converting_again_is_a_no_op(converted, source):
    store, directory = converted
    before = (directory / "weights.bin").stat().st_mtime_ns
    assert convert(store, source, "exact") == directory
    assert (directory / "weights.bin").stat().st_mtime_ns == before


def test_an_interrupted_conversion_leaves_nothing_behind(tmp_path, source, monkeypatch):
    store = ModelStore(home=tmp_path)

    def interrupted(self, i, h):  # Ctrl-C in the second layer, with weights half written
        if i == 1:
            raise KeyboardInterrupt
        return mlp(self, i, h)

    mlp = graph_mod._Qwen2.mlp
    monkeypatch.setattr(graph_mod._Qwen2, "mlp", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(store, source, "exact")
    assert not onnx_dir_for(store, source, "exact").exists()
    assert list(store.tmp_dir.glob("*.partial")) == []


def test_other_architectures_and_bits_are_refused(tmp_path, model_path, source):
    store = ModelStore(home=tmp_path)
    with pytest.raises(UnsupportedModel, match=r"architecture 'gemma3' cannot be converted") as exc:
        convert(store, model_path(GEMMA))
    assert "\n" not in str(exc.value)
    with pytest.raises(InvalidRequest, match="--bits must be one of exact, 4"):
        convert(store, source, "3")
    assert not (tmp_path / "onnx").exists()


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, EDGESPEC_HOME=str(home), COLUMNS="200",
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_cli_refuses_an_unsupported_model_in_one_line(tmp_path, model_path):
    r = _cli(tmp_path, "models", "convert-onnx", str(model_path(GEMMA)))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "architecture 'gemma3' cannot be converted" in lines[0]


def test_cli_converts_into_the_store_next_to_the_gguf(tmp_path, source):
    models = tmp_path / "imported"
    models.mkdir()
    os.link(source, models / "drafter.gguf") if os.stat(source).st_dev == os.stat(tmp_path).st_dev \
        else shutil.copy(source, models / "drafter.gguf")
    r = _cli(tmp_path, "models", "convert-onnx", str(models / "drafter.gguf"), "--bits", "exact")
    assert r.returncode == 0, r.stderr
    assert (models / "drafter.exact.onnx" / "model.onnx").is_file()
    assert str(models / "drafter.exact.onnx") in r.stdout
