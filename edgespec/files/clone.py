"""Shape clones: a real model's GGUF header with random weights, optionally at another size.

The speed of a dense transformer does not depend on its weight values, and real weights cannot
travel to the GPU test machine (64 MiB per call), so timings there use *shape clones*: SRC's
metadata (tokenizer included, copied byte for byte), tensor names, shapes and quantization
types, with random but valid blocks.  Shape options scale a model within its family, e.g. a
7B-shaped Qwen2.5 from the 1.5B's header::

    write_clone("qwen-1.5b.gguf", "qwen-7b-shape.gguf",
                CloneShape(layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4))

A clone needs only SRC's header (metadata and tensor infos): ``header_only=True`` writes the
header of the clone without data, a few MB that travel where the model cannot, and a clone
made from that file equals one made from the full model.

Weights: every quantized block gets uniform random quants and fp16 scales chosen so that the
dequantized weights have a standard deviation near 0.02, as a trained model's do (measured per
type with gguf-py's dequantizer; tests/test_clone.py checks it).  Norm weights are 1, other
float tensors N(0, 0.02).  So activations stay far from fp16's range and llama.cpp decodes
finite logits.  The file is written tensor by tensor in chunks of a few MB.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from edgespec.errors import CloneError
from edgespec.files.gguf import GGUFHeader, read_gguf_header
from edgespec.files.gguf_structure import GGML_TYPES, GGUF_MAGIC, TensorInfo

log = logging.getLogger(__name__)

_CHUNK_BYTES = 8 << 20  # random data generated per step: bounds memory whatever the tensor

#: Quantized types: fp16 scale fields of a block as (byte offset, value).  Values make the
#: dequantized weights' std ~0.02 with uniform random quants and sub-scales (measured with
#: gguf-py; a second field is the block minimum, set to centre the weights).  Some values are
#: fp16 subnormals: still exact enough, and finite.
_BLOCK_SCALES: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 4.3e-3),),
    "Q4_1": ((0, 4.3e-3), (2, -8 * 4.3e-3)),
    "Q5_0": ((0, 2.2e-3),),
    "Q5_1": ((0, 2.2e-3), (2, -16 * 2.2e-3)),
    "Q8_0": ((0, 2.7e-4),),
    "Q2_K": ((80, 1.4e-3), (82, 1.5 * 1.4e-3)),
    "Q3_K": ((108, 4.6e-4),),
    "Q4_K": ((0, 7.7e-5), (2, 7.5 * 7.7e-5)),
    "Q5_K": ((0, 3.8e-5), (2, 15.5 * 3.8e-5)),
    "Q6_K": ((208, 1.5e-5),),
    "IQ4_NL": ((0, 3.0e-4),),
    "IQ4_XS": ((0, 1.6e-5),),
}
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.float32}
_WEIGHT_STD = 0.02

#: Dimension roles of each tensor, in ggml order (shape[0] = row length): E hidden size,
#: F feed-forward size, Q query width (heads x head dim), K key/value width, V vocabulary,
#: D head dim.  These are llama.cpp's names for dense decoder-only models (llama, qwen2/3,
#: mistral, gemma).  A tensor not listed keeps its shape; width options refuse such tensors.
_ROLES: dict[str, tuple[str, ...]] = {
    "token_embd.weight": ("E", "V"), "output.weight": ("E", "V"), "output_norm.weight": ("E",),
    "attn_norm.weight": ("E",), "ffn_norm.weight": ("E",),
    "post_attention_norm.weight": ("E",), "post_ffw_norm.weight": ("E",),
    "attn_q.weight": ("E", "Q"), "attn_q.bias": ("Q",),
    "attn_k.weight": ("E", "K"), "attn_k.bias": ("K",),
    "attn_v.weight": ("E", "K"), "attn_v.bias": ("K",),
    "attn_output.weight": ("Q", "E"),
    "attn_q_norm.weight": ("D",), "attn_k_norm.weight": ("D",),
    "ffn_gate.weight": ("E", "F"), "ffn_up.weight": ("E", "F"), "ffn_down.weight": ("F", "E"),
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")

# Metadata keys (after "<arch>.") that hold the shape.
_SHAPE_KEYS = {"layers": "block_count", "hidden": "embedding_length",
               "ffn": "feed_forward_length", "heads": "attention.head_count",
               "kv_heads": "attention.head_count_kv"}
_INT_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
_GGUF_STRING, _GGUF_UINT32 = 8, 4


@dataclass(frozen=True)
class CloneShape:
    """Target shape; None keeps SRC's value.  Head dim stays SRC's."""

    layers: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    heads: int | None = None
    kv_heads: int | None = None


@dataclass(frozen=True)
class CloneResult:
    """What was written."""

    path: str
    tensors: int
    data_bytes: int
    file_size: int
    header_only: bool
    shape: dict[str, int]


@dataclass(frozen=True)
class _Plan:
    """The clone's metadata records (encoded) and tensor infos (offsets relative to data)."""

    kv: tuple[bytes, ...]
    tensors: tuple[tuple[str, tuple[int, ...], int, int, int], ...]  # name, shape, type, off, nbytes
    alignment: int
    shape: dict[str, int]


def _arch_int(header: GGUFHeader, arch: str, suffix: str) -> int | None:
    value = header.metadata.get(f"{arch}.{suffix}")
    if isinstance(value, list):
        raise CloneError(f"{header.path}: per-layer {arch}.{suffix} is not supported by clone")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _source_dims(header: GGUFHeader) -> dict[str, int]:
    """SRC's shape from its metadata: layers, hidden, ffn, heads, kv_heads, head_dim."""
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CloneError(f"{header.path}: no general.architecture, not a model file")
    dims = {opt: _arch_int(header, arch, key) for opt, key in _SHAPE_KEYS.items()}
    missing = [_SHAPE_KEYS[k] for k, v in dims.items() if not v]
    if missing:
        raise CloneError(f"{header.path}: metadata lacks {', '.join(missing)}")
    key_length = _arch_int(header, arch, "attention.key_length")
    dims["head_dim"] = key_length or dims["hidden"] // dims["heads"]
    dims["explicit_head_dim"] = int(key_length is not None)
    return dims


def _clone_dims(src: dict[str, int], shape: CloneShape) -> dict[str, int]:
    """The clone's shape: SRC's, overridden by ``shape``; refuses inconsistent options."""
    for name in _SHAPE_KEYS:
        value = getattr(shape, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CloneError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    new = dict(src)
    new.update({k: getattr(shape, k) for k in _SHAPE_KEYS if getattr(shape, k) is not None})
    hd = src["head_dim"]
    if shape.hidden is not None and shape.heads is None and not src["explicit_head_dim"]:
        if shape.hidden % hd:  # keep the head dim: heads follow the width
            raise CloneError(f"--hidden {shape.hidden} is not a multiple of the head dim {hd}; "
                             f"give --heads too")
        new["heads"] = shape.hidden // hd
    if not src["explicit_head_dim"] and new["heads"] * hd != new["hidden"]:
        raise CloneError(f"--hidden {new['hidden']} must equal heads ({new['heads']}) x head dim "
                         f"({hd}) = {new['heads'] * hd}")
    if new["heads"] % new["kv_heads"]:
        raise CloneError(f"heads ({new['heads']}) must be a multiple of kv heads ({new['kv_heads']})")
    return new


def _role_sizes(d: dict[str, int]) -> dict[str, int]:
    return {"E": d["hidden"], "F": d["ffn"], "Q": d["heads"] * d["head_dim"],
            "K": d["kv_heads"] * d["head_dim"], "D": d["head_dim"]}


def _scaled_shape(t: TensorInfo, suffix: str, src: dict[str, int],
                  new: dict[str, int]) -> tuple[int, ...]:
    """``t``'s shape in the clone; checks SRC's shape against the roles it should have."""
    old_sizes, new_sizes = _role_sizes(src), _role_sizes(new)
    if old_sizes == new_sizes:  # only the depth changes (or nothing)
        return t.shape
    roles = _ROLES.get(suffix)
    if roles is None or len(roles) != len(t.shape):
        raise CloneError(f"cannot rescale tensor {t.name!r} {list(t.shape)}: its dimensions' "
                         f"roles are unknown; clone it without width options")
    shape = []
    for role, dim in zip(roles, t.shape):
        if role == "V":
            shape.append(dim)
            continue
        if dim != old_sizes[role]:
            raise CloneError(f"tensor {t.name!r} {list(t.shape)} does not have the expected "
                             f"{role}-size {old_sizes[role]}; its architecture is not supported")
        shape.append(new_sizes[role])
    block = GGML_TYPES[t.ggml_type][1]
    if shape[0] % block:
        raise CloneError(f"tensor {t.name!r} of type {t.type_name} needs rows that are a multiple "
                         f"of {block}, but the clone's rows have {shape[0]} elements")
    return tuple(shape)


def _clone_tensors(header: GGUFHeader, src: dict[str, int],
                   new: dict[str, int]) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, ggml type) of every clone tensor, in SRC's order; layer i of the clone
    copies the types of SRC's layer i * src_layers // layers (quantizers vary types by depth)."""
    by_layer: dict[int, list[tuple[str, TensorInfo]]] = {}
    order: list[tuple[str, object]] = []
    for t in header.tensors:
        m = _BLOCK_NAME.match(t.name)
        if m is None:
            order.append(("global", t))
            continue
        layer = int(m.group(1))
        if layer not in by_layer:
            order.append(("layers", layer))
        by_layer.setdefault(layer, []).append((m.group(2), t))
    if sorted(by_layer) != list(range(src["layers"])):
        raise CloneError(f"{header.path}: tensors do not cover blocks 0..{src['layers'] - 1}")
    out: list[tuple[str, tuple[int, ...], int]] = []
    for kind, item in order:
        if kind == "global":
            t = item  # type: ignore[assignment]
            out.append((t.name, _scaled_shape(t, t.name, src, new), t.ggml_type))
        elif item == 0:  # all blocks go where SRC's first block was
            for i in range(new["layers"]):
                for suffix, t in by_layer[i * src["layers"] // new["layers"]]:
                    out.append((f"blk.{i}.{suffix}", _scaled_shape(t, suffix, src, new), t.ggml_type))
    return out


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv_record(key: str, vtype: int, value: int | str) -> bytes:
    if vtype == _GGUF_STRING:
        return _string(key) + struct.pack("<I", vtype) + _string(str(value))
    return _string(key) + struct.pack("<I", vtype) + struct.pack("<" + _INT_FORMATS[vtype], value)


def _raw_type(header: GGUFHeader, key: str) -> int:
    """A key's GGUF value type, read from its exact encoding."""
    (vtype,) = struct.unpack_from("<I", header.raw_kv[key], 8 + len(key.encode("utf-8")))
    return vtype


def _clone_kv(header: GGUFHeader, new: dict[str, int], seed: int) -> list[bytes]:
    """SRC's metadata byte for byte, but for the shape keys and two keys naming the clone."""
    arch = header.metadata["general.architecture"]
    changed = {f"{arch}.{key}": new[opt] for opt, key in _SHAPE_KEYS.items()}
    source = header.metadata.get("edgespec.clone.of") or header.metadata.get("general.name") \
        or os.path.basename(header.path)
    added = {"edgespec.clone.of": (_GGUF_STRING, str(source)),
             "edgespec.clone.seed": (_GGUF_UINT32, seed)}
    out = []
    for key, raw in header.raw_kv.items():
        if key in changed:
            vtype = _raw_type(header, key)
            if vtype not in _INT_FORMATS:
                raise CloneError(f"{header.path}: {key} is not an integer")
            out.append(_kv_record(key, vtype, changed[key]))
        elif key in added:
            out.append(_kv_record(key, *added.pop(key)))
        else:
            out.append(raw)
    out.extend(_kv_record(key, vtype, value) for key, (vtype, value) in added.items())
    return out


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def plan_clone(header: GGUFHeader, shape: CloneShape = CloneShape(), seed: int = 0) -> _Plan:
    """Everything of the clone but its weights; raises CloneError for a shape it cannot make."""
    if not 0 <= seed < 2**32:
        raise CloneError(f"--seed must be in [0, 2^32), got {seed}")
    src = _source_dims(header)
    new = _clone_dims(src, shape)
    tensors, offset = [], 0
    for name, tshape, ggml_type in _clone_tensors(header, src, new):
        tname, block, type_size = GGML_TYPES[ggml_type]
        if tname not in _BLOCK_SCALES and tname not in _FLOAT_TYPES:
            raise CloneError(f"tensor {name!r} has type {tname}, which clone cannot fill "
                             f"(supported: {', '.join([*_FLOAT_TYPES, *_BLOCK_SCALES])})")
        nbytes = int(np.prod(tshape, dtype=np.int64)) // block * type_size
        tensors.append((name, tshape, ggml_type, offset, nbytes))
        offset += _pad(nbytes, header.alignment)
    dims = {k: new[k] for k in (*_SHAPE_KEYS, "head_dim")}
    return _Plan(tuple(_clone_kv(header, new, seed)), tuple(tensors), header.alignment, dims)


def _write_header(f: BinaryIO, plan: _Plan) -> int:
    """Writes magic to the padded end of the tensor infos; returns the data section's offset."""
    f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(plan.tensors), len(plan.kv)))
    f.writelines(plan.kv)
    f.writelines(_string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape,
                                            ggml_type, offset) for name, shape, ggml_type, offset, _ in plan.tensors)
    pos = f.tell()
    f.write(b"\0" * (_pad(pos, plan.alignment) - pos))
    return f.tell()


def _float_chunk(rng: np.random.Generator, name: str, tname: str, n: int) -> bytes:
    if name.endswith("norm.weight"):
        values = np.ones(n, dtype=np.float32)  # RMSNorm gains of 1: activations keep their scale
    else:
        values = rng.standard_normal(n, dtype=np.float32) * np.float32(_WEIGHT_STD)
    if tname == "BF16":  # bfloat16 is the upper half of a float32
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.astype(_FLOAT_TYPES[tname]).tobytes()


def _block_chunk(rng: np.random.Generator, tname: str, n_blocks: int, type_size: int) -> bytes:
    """``n_blocks`` blocks of random quants with the type's fixed fp16 scales."""
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * type_size)), dtype=np.uint8)
    blocks = blocks.reshape(n_blocks, type_size)
    for offset, value in _BLOCK_SCALES[tname]:
        blocks[:, offset:offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return blocks.tobytes()


def _write_tensor(f: BinaryIO, rng: np.random.Generator, name: str, shape: tuple[int, ...],
                  ggml_type: int, nbytes: int, alignment: int) -> None:
    """Streams one tensor's random data in chunks of at most ~_CHUNK_BYTES, then its padding."""
    tname, _, type_size = GGML_TYPES[ggml_type]
    n_blocks = nbytes // type_size
    per_chunk = max(1, _CHUNK_BYTES // type_size)
    for start in range(0, n_blocks, per_chunk):
        count = min(per_chunk, n_blocks - start)
        if tname in _FLOAT_TYPES:
            f.write(_float_chunk(rng, name, tname, count))
        else:
            f.write(_block_chunk(rng, tname, count, type_size))
    f.write(b"\0" * (_pad(nbytes, alignment) - nbytes))


def write_clone(src: str | os.PathLike, out: str | os.PathLike,
                shape: CloneShape = CloneShape(), seed: int = 0,
                header_only: bool = False) -> CloneResult:
    """Writes a shape clone of the GGUF file (or header-only file) ``src`` to ``out``.

    Args:
        src: a GGUF model, or a header-only file written by ``header_only=True``.
        out: the clone's path; written to ``out + ".part"`` and renamed when complete.
        shape: the clone's shape (None fields keep SRC's).
        seed: seed of the random weights (same seed, same bytes).
        header_only: write only the header (metadata and tensor infos), a few MB.
    Returns:
        a CloneResult.
    Raises:
        InvalidGGUF: ``src`` is not a GGUF header.
        CloneError: a shape option is inconsistent, or a tensor cannot be rescaled or filled.
    """
    header = read_gguf_header(src)
    plan = plan_clone(header, shape, seed)
    out = os.fspath(out)
    tmp = out + ".part"
    rng = np.random.default_rng(seed)
    try:
        with open(tmp, "wb") as f:
            data_offset = _write_header(f, plan)
            if not header_only:
                for name, tshape, ggml_type, offset, nbytes in plan.tensors:
                    assert f.tell() == data_offset + offset
                    _write_tensor(f, rng, name, tshape, ggml_type, nbytes, plan.alignment)
            size = f.tell()
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    data = sum(t[4] for t in plan.tensors)
    log.info("wrote %s%s: %d tensors, %d data bytes, shape %s", out,
             " (header only)" if header_only else "", len(plan.tensors), data, plan.shape)
    return CloneResult(out, len(plan.tensors), data, size, header_only, plan.shape)
