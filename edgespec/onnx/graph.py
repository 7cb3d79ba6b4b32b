"""A Qwen2 GGUF model -> one ONNX graph for onnxruntime, weights streamed to an external file.

The graph decodes a batch of ``S`` new tokens of one sequence against a KV buffer of any length
(``max_ctx``) that the caller binds as both ``past_*`` input and ``present_*`` output, so
GroupQueryAttention writes the new entries in place:

    inputs  input_ids [1, S] int64, position_ids [1, S] int64 (rotary positions),
            attention_bias [1, 1, S, T] float (0 or -inf; T = past + S), seqlens_k [1] int32
            (= T - 1), total_sequence_length [] int32 (= T), logit_rows [L] int64 (which of the
            S rows to score), past_key.<i> / past_value.<i> [1, n_head_kv, max_ctx, head_dim]
    outputs logits [1, L, n_vocab], present_key.<i> / present_value.<i> (the same buffers)

New token ``j`` is written at slot ``T - S + j``; GroupQueryAttention itself masks slots after
it, and ``attention_bias`` masks the rest (the siblings of a draft tree).
"""
from __future__ import annotations

import logging
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgespec.errors import UnsupportedModel
from edgespec.files.gguf import GGUFFile
from edgespec.onnx.blocks import QuantWeight, decode, pack, requantize4

log = logging.getLogger(__name__)

MS = "com.microsoft"
OPSET = 23
# 8-bit MatMulNBits is fast on the CPU only with int8 compute (accuracy_level 4): the exact
# 0.5B drafter took 4.1 s a token at level 0 against 0.10 s at level 4 (2-core VM, same load).
ACCURACY_LEVEL = 4
ARCHITECTURES = ("qwen2",)
_ALIGN = 1 << 16  # large initializers start on a 64 KiB boundary so onnxruntime can map them
_INLINE = 1 << 12  # smaller initializers stay in model.onnx


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters a graph needs, read from GGUF metadata."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    rope_base: float
    eps: float
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelShape:
        """Raises UnsupportedModel for an architecture the graph builder does not know."""
        md = g.metadata
        arch = md.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(f"{g.path}: architecture {arch!r} cannot be converted to ONNX "
                                   f"(supported: {', '.join(ARCHITECTURES)})")
        if md.get(f"{arch}.rope.scaling.type", "none") not in ("none", None):
            raise UnsupportedModel(f"{g.path}: rope scaling {md[f'{arch}.rope.scaling.type']!r} "
                                   "is not supported by the ONNX converter")
        return cls(n_layer=md[f"{arch}.block_count"], n_embd=md[f"{arch}.embedding_length"],
                   n_head=md[f"{arch}.attention.head_count"],
                   n_head_kv=md[f"{arch}.attention.head_count_kv"],
                   n_vocab=len(md["tokenizer.ggml.tokens"]),
                   rope_base=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
                   eps=float(md[f"{arch}.attention.layer_norm_rms_epsilon"]),
                   max_positions=int(md.get(f"{arch}.context_length", 32768)))

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class GGUFTensors:
    """Tensor bytes of a validated GGUF file, read through one read-only mapping."""

    def __init__(self, g: GGUFFile):
        self.g = g
        self.by_name = {t.name: t for t in g.tensors}
        with open(g.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str) -> QuantWeight | np.ndarray:
        """A 2-D tensor as QuantWeight / float32 [rows, row length]; a 1-D one as float32."""
        t = self.by_name[name]
        raw = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
        k = t.shape[0]
        n = t.n_elements // k
        w = decode(t.type_name, raw, n, k)
        return w.reshape(-1) if len(t.shape) == 1 else w

    def close(self) -> None:
        self._map.close()


class _Builder:
    """Nodes and initializers of one graph; initializer bytes go straight to ``data_path``."""

    def __init__(self, data_path: Path):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._data = open(data_path, "wb")  # noqa: SIM115 - written across calls, closed by close()
        self._location = data_path.name
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def init(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        if array.nbytes < _INLINE:  # shapes and axes must be inline for shape inference
            self.inits.append(numpy_helper.from_array(array, name))
            return name
        if array.nbytes >= _ALIGN:
            self._data.seek(-self._data.tell() % _ALIGN, os.SEEK_CUR)
        offset = self._data.tell()
        self._data.write(array.tobytes())
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                        dims=array.shape, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self._location), ("offset", str(offset)),
                           ("length", str(array.nbytes))):
            t.external_data.add(key=key, value=value)
        self.inits.append(t)
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str]:
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain or None, **attrs))
        return outs

    def close(self) -> None:
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()


# -- layers -----------------------------------------------------------------------------------
def _fusable(ws: list) -> bool:
    """Whether weights can be concatenated along n into one MatMulNBits."""
    if not all(isinstance(w, QuantWeight) for w in ws):
        return False
    key = {(w.bits, w.block, w.zeros is None, w.offsets is None, w.shape[1]) for w in ws}
    return len(key) == 1


def _concat(ws: list[QuantWeight]) -> QuantWeight:
    def cat(field):
        parts = [getattr(w, field) for w in ws]
        return None if parts[0] is None else np.concatenate(parts, axis=0)

    return QuantWeight(cat("q"), cat("scales"), ws[0].bits, ws[0].block, cat("zeros"), cat("offsets"))


def linear(b: _Builder, x: str, w: QuantWeight | np.ndarray, name: str) -> str:
    """``x @ w.T`` for x [..., k]: MatMulNBits, plus the block-offset correction if any."""
    if isinstance(w, np.ndarray):
        return b.op("MatMul", [x, b.init(f"{name}.t", w.T.astype(np.float32))])[0]
    n, k = w.shape
    packed, zeros = pack(w)
    inputs = [x, b.init(f"{name}.q", packed), b.init(f"{name}.scales", w.scales.reshape(-1))]
    if zeros is not None:
        inputs.append(b.init(f"{name}.zeros", zeros.reshape(-1)))
    y = b.op("MatMulNBits", inputs, domain=MS, K=k, N=n, bits=w.bits, block_size=w.block,
             accuracy_level=ACCURACY_LEVEL)[0]
    if w.offsets is None:
        return y
    # sum_k x[k] * offset[block(k)] = (per-block sums of x) @ offsets.T
    nb = k // w.block
    blocks = b.op("Reshape", [x, b.init(f"{name}.blockshape", np.array([0, 0, nb, w.block], np.int64))])[0]
    sums = b.op("ReduceSum", [blocks, b.init(f"{name}.axis", np.array([-1], np.int64))], keepdims=0)[0]
    corr = b.op("MatMul", [sums, b.init(f"{name}.offsets", w.offsets.T.copy())])[0]
    return b.op("Add", [y, corr])[0]


def linear_many(b: _Builder, x: str, ws: list, biases: list, name: str) -> list[str]:
    """Several linears of one input; one fused MatMulNBits (then Split) when formats agree."""
    if _fusable(ws):
        y = linear(b, x, _concat(ws), name)
        if all(bias is not None for bias in biases):
            y = b.op("Add", [y, b.init(f"{name}.bias", np.concatenate(biases))])[0]
            biases = [None] * len(ws)
        sizes = b.init(f"{name}.split", np.array([w.shape[0] for w in ws], np.int64))
        outs = b.op("Split", [y, sizes], n_out=len(ws), axis=-1)
    else:
        outs = [linear(b, x, w, f"{name}.{i}") for i, w in enumerate(ws)]
    return [o if bias is None else b.op("Add", [o, b.init(f"{name}.bias{i}", bias)])[0]
            for i, (o, bias) in enumerate(zip(outs, biases))]


def embedding(b: _Builder, ids: str, w: QuantWeight | np.ndarray, n_embd: int) -> str:
    """Rows of the token embedding: GatherBlockQuantized over 8-bit blocks (4-bit ones widened)."""
    if isinstance(w, np.ndarray):
        return b.op("Gather", [b.init("embed.table", w), ids], axis=0)[0]
    zeros = w.zeros if w.zeros is not None else np.full(w.scales.shape, 1 << (w.bits - 1), np.uint8)
    q8 = (w.q.reshape(*w.scales.shape, w.block).astype(np.int16) - zeros[..., None] + 128)
    rows = b.op("GatherBlockQuantized", [b.init("embed.q", q8.astype(np.uint8).reshape(w.shape)), ids,
                                         b.init("embed.scales", w.scales)],
                domain=MS, bits=8, block_size=w.block, gather_axis=0, quantize_axis=1)[0]
    if w.offsets is None:
        return rows
    nb = w.scales.shape[1]
    split = b.op("Reshape", [rows, b.init("embed.blocks", np.array([0, 0, nb, w.block], np.int64))])[0]
    off = b.op("Gather", [b.init("embed.offsets", w.offsets[..., None].copy()), ids], axis=0)[0]
    summed = b.op("Add", [split, off])[0]
    return b.op("Reshape", [summed, b.init("embed.shape", np.array([0, 0, n_embd], np.int64))])[0]


def rotary_caches(shape: ModelShape) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [max_positions, head_dim / 2] of NeoX-style rotary embeddings (as llama.cpp's qwen2)."""
    d = shape.head_dim
    inv = shape.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(shape.max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class _Qwen2:
    """Emits the Qwen2 graph layer by layer, one GGUF tensor decoded at a time."""

    def __init__(self, b: _Builder, tensors: GGUFTensors, shape: ModelShape, bits: str):
        self.b, self.t, self.s, self.bits = b, tensors, shape, bits

    def weight(self, name: str):
        w = self.t.get(name)
        if self.bits == "4" and isinstance(w, QuantWeight) and (w.bits != 4 or w.offsets is not None):
            return requantize4(w)
        return w

    def norm(self, delta: str | None, residual: str, gamma: str) -> tuple[str, str]:
        """RMS norm of ``residual + delta``; returns (normed, the new residual)."""
        g = self.b.init(gamma, self.t.get(gamma))
        if delta is None:
            return self.b.op("RMSNormalization", [residual, g], axis=-1, epsilon=self.s.eps)[0], residual
        out = self.b.op("SkipSimplifiedLayerNormalization", [delta, residual, g], n_out=4,
                        domain=MS, epsilon=self.s.eps)
        return out[0], out[3]

    def attention(self, i: int, h: str) -> str:
        p, s, b = f"blk.{i}.attn_", self.s, self.b
        q, k, v = linear_many(b, h, [self.weight(f"{p}{x}.weight") for x in "qkv"],
                              [self.t.get(f"{p}{x}.bias") if f"{p}{x}.bias" in self.t else None
                               for x in "qkv"], f"{p}qkv")
        out = b.op("GroupQueryAttention",
                   [q, k, v, f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total_sequence_length",
                    "rotary.cos", "rotary.sin", "position_ids", "attention_bias"],
                   n_out=3, domain=MS, num_heads=s.n_head, kv_num_heads=s.n_head_kv, do_rotary=1,
                   rotary_interleaved=0, scale=1.0 / math.sqrt(s.head_dim))
        b.nodes[-1].output[1:] = [f"present_key.{i}", f"present_value.{i}"]
        return linear(b, out[0], self.weight(f"{p}output.weight"), f"{p}output")

    def mlp(self, i: int, h: str) -> str:
        p, b = f"blk.{i}.ffn_", self.b
        gate, up = linear_many(b, h, [self.weight(f"{p}gate.weight"), self.weight(f"{p}up.weight")],
                               [None, None], f"{p}gate_up")
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate])[0]])[0]
        return linear(b, b.op("Mul", [act, up])[0], self.weight(f"{p}down.weight"), f"{p}down")

    def build(self) -> str:
        """All layers; returns the logits output name."""
        cos, sin = rotary_caches(self.s)
        self.b.init("rotary.cos", cos)
        self.b.init("rotary.sin", sin)
        residual = embedding(self.b, "input_ids", self.t.get("token_embd.weight"), self.s.n_embd)
        delta = None
        for i in range(self.s.n_layer):
            h, residual = self.norm(delta, residual, f"blk.{i}.attn_norm.weight")
            h, residual = self.norm(self.attention(i, h), residual, f"blk.{i}.ffn_norm.weight")
            delta = self.mlp(i, h)
        h, _ = self.norm(delta, residual, "output_norm.weight")
        rows = self.b.op("Gather", [h, "logit_rows"], axis=1)[0]
        head = "output.weight" if "output.weight" in self.t else "token_embd.weight"  # tied
        return linear(self.b, rows, self.weight(head), "output")


def _io(shape: ModelShape, logits: str) -> tuple[list, list]:
    f, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    kv = [1, shape.n_head_kv, "max_ctx", shape.head_dim]
    vi = helper.make_tensor_value_info
    inputs = [vi("input_ids", i64, [1, "S"]), vi("position_ids", i64, [1, "S"]),
              vi("attention_bias", f, [1, 1, "S", "T"]), vi("seqlens_k", i32, [1]),
              vi("total_sequence_length", i32, []), vi("logit_rows", i64, ["L"])]
    outputs = [vi(logits, f, [1, "L", shape.n_vocab])]
    for i in range(shape.n_layer):
        inputs += [vi(f"past_key.{i}", f, kv), vi(f"past_value.{i}", f, kv)]
        outputs += [vi(f"present_key.{i}", f, kv), vi(f"present_value.{i}", f, kv)]
    return inputs, outputs


def write_graph(g: GGUFFile, directory: Path, bits: str = "exact") -> ModelShape:
    """Writes ``model.onnx`` and its weights file ``weights.bin`` into ``directory``.

    Args:
        g: a validated GGUF file.
        bits: "exact" keeps every ggml block as it is; "4" requantizes 8-bit blocks to 4 bits.
    Raises:
        UnsupportedModel: architecture or tensor format without an exact mapping.
    """
    shape = ModelShape.from_gguf(g)
    tensors = GGUFTensors(g)
    builder = _Builder(directory / "weights.bin")
    try:
        head = _Qwen2(builder, tensors, shape, bits).build()
    finally:
        builder.close()
        tensors.close()
    assert builder.nodes[-1].output[0] == head  # the head's last node: give it the graph's name
    builder.nodes[-1].output[0] = "logits"
    inputs, outputs = _io(shape, "logits")
    graph = helper.make_graph(builder.nodes, "edgespec-drafter", inputs, outputs, builder.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    onnx.save_model(model, str(directory / "model.onnx"))
    onnx.checker.check_model(str(directory / "model.onnx"))
    return shape
