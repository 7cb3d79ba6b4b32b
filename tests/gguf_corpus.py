"""Generates a corpus of GGUF files: one small valid model and many corrupt or hostile variants.

Nothing here is checked in as binary: :func:`build_corpus` writes the files into a directory
(a pytest tmp_path) from code, so each hostile case says exactly how it was made.

The writer is deliberately independent of ``edgespec.files.gguf`` (it shares no code with the reader
it tests) and deliberately permissive: tensors carry their data bytes and their declared
shape separately, counts and offsets can be overridden, keys may be raw bytes, so that every
kind of inconsistency can be expressed.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

# GGUF metadata value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f",
               BOOL: "?", U64: "Q", I64: "q", F64: "d"}

# ggml tensor types used by the corpus.
GGML_F32, GGML_Q8_0 = 0, 8

BIG = 2**63 - 1  # the largest count a signed 64-bit reader could accept


@dataclass
class KV:
    """A metadata pair.  ``value`` of an ARRAY is ``(element_type, [elements])``; ``raw``
    bytes, when given, replace the encoded value (for unknown value types)."""

    key: str | bytes
    vtype: int
    value: Any = None
    raw: bytes | None = None


@dataclass
class Tensor:
    """A tensor: declared shape and type, its data bytes, and optionally a forced offset."""

    name: str | bytes
    shape: tuple[int, ...]
    ggml_type: int
    data: bytes
    offset: int | None = None  # relative offset; None = packed after the previous tensor


@dataclass
class Spec:
    """Everything the writer needs; mutations copy and edit it."""

    kvs: list[KV]
    tensors: list[Tensor]
    magic: bytes = b"GGUF"
    version: int = 3
    alignment: int = 64  # used to lay out data; the file says so only if a KV does
    n_kv: int | None = None  # override the counts written in the header
    n_tensors: int | None = None
    trailing: bytes = b""


@dataclass
class Layout:
    """Where things landed in a written file, so mutations can patch bytes."""

    n_tensors_at: int = 0
    n_kv_at: int = 0
    kv_at: dict[str, int] = field(default_factory=dict)  # start of each key-value pair
    value_at: dict[str, int] = field(default_factory=dict)  # start of each value
    tensor_info_at: dict[str, int] = field(default_factory=dict)
    header_end: int = 0
    data_offset: int = 0
    tensor_data_at: dict[str, int] = field(default_factory=dict)  # absolute
    size: int = 0


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack("<" + _SCALAR_FMT[vtype], value)


_MAX_WRITTEN_DATA = 1 << 20


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def serialize(spec: Spec) -> tuple[bytes, Layout]:
    """Encode a Spec as GGUF bytes and report where each part went."""
    lay = Layout()
    out = bytearray(spec.magic + struct.pack("<I", spec.version))
    lay.n_tensors_at = len(out)
    out += struct.pack("<Q", len(spec.tensors) if spec.n_tensors is None else spec.n_tensors)
    lay.n_kv_at = len(out)
    out += struct.pack("<Q", len(spec.kvs) if spec.n_kv is None else spec.n_kv)
    for kv in spec.kvs:
        name = kv.key if isinstance(kv.key, str) else repr(kv.key)
        lay.kv_at[name] = len(out)
        out += _string(kv.key) + struct.pack("<I", kv.vtype)
        lay.value_at[name] = len(out)
        out += kv.raw if kv.raw is not None else _value(kv.vtype, kv.value)
    offsets = _offsets(spec)
    for t, off in zip(spec.tensors, offsets):
        name = t.name if isinstance(t.name, str) else repr(t.name)
        lay.tensor_info_at[name] = len(out)
        out += _string(t.name) + struct.pack("<I", len(t.shape))
        out += b"".join(struct.pack("<Q", d) for d in t.shape)
        out += struct.pack("<IQ", t.ggml_type, off)
    lay.header_end = len(out)
    lay.data_offset = _pad(len(out), spec.alignment)
    data = bytearray()
    for t, off in zip(spec.tensors, offsets):
        name = t.name if isinstance(t.name, str) else repr(t.name)
        lay.tensor_data_at[name] = lay.data_offset + off
        end = off + len(t.data)
        if end > _MAX_WRITTEN_DATA:  # an absurd forced offset: declare it, write no data
            continue
        if len(data) < end:
            data += bytes(end - len(data))
        data[off:end] = t.data
    if spec.tensors:
        out += bytes(lay.data_offset - len(out))
        out += data + bytes(_pad(len(data), spec.alignment) - len(data))
    out += spec.trailing
    lay.size = len(out)
    return bytes(out), lay


def _offsets(spec: Spec) -> list[int]:
    """Relative data offsets: forced ones as given, the others packed in order."""
    offsets, cursor = [], 0
    for t in spec.tensors:
        off = cursor if t.offset is None else t.offset
        offsets.append(off)
        cursor = _pad(max(cursor, off + len(t.data)), spec.alignment)
    return offsets


def _q8_0_blocks(n_blocks: int, seed: int) -> bytes:
    """Deterministic Q8_0 data: per block an f16 scale and 32 int8 quants."""
    out = bytearray()
    for b in range(n_blocks):
        out += struct.pack("<e", 0.01 * (b + 1))
        out += bytes(((seed + b * 7 + i * 3) % 256) for i in range(32))
    return bytes(out)


VALID_TOKENS = ["<s>", "</s>", "a", "b", "ab", " hello", "é", "\u2581the"]


def valid_spec() -> Spec:
    """The small, well-formed model: a few KVs of every type, three tensors (F32 and Q8_0)."""
    kvs = [
        KV("general.architecture", STRING, "llama"),
        KV("general.name", STRING, "edgespec corpus model"),
        KV("general.alignment", U32, 64),
        KV("general.file_type", U32, 7),  # LLAMA_FTYPE_MOSTLY_Q8_0
        KV("llama.context_length", U32, 256),
        KV("llama.block_count", U32, 1),
        KV("llama.embedding_length", U32, 32),
        KV("llama.attention.head_count", U32, 4),
        KV("llama.attention.head_count_kv", U32, 2),
        KV("llama.rope.freq_base", F32, 10000.0),
        KV("tokenizer.ggml.model", STRING, "gpt2"),
        KV("tokenizer.ggml.tokens", ARRAY, (STRING, VALID_TOKENS)),
        KV("tokenizer.ggml.scores", ARRAY, (F32, [float(-i) for i in range(len(VALID_TOKENS))])),
        KV("tokenizer.ggml.token_type", ARRAY, (I32, [3, 3] + [1] * (len(VALID_TOKENS) - 2))),
        KV("tokenizer.chat_template", STRING, "{% for m in messages %}{{ m.content }}{% endfor %}"),
        KV("edgespec.test.u8", U8, 200),
        KV("edgespec.test.i8", I8, -3),
        KV("edgespec.test.u16", U16, 60000),
        KV("edgespec.test.i16", I16, -30000),
        KV("edgespec.test.i32", I32, -70000),
        KV("edgespec.test.u64", U64, 2**40 + 1),
        KV("edgespec.test.i64", I64, -(2**40)),
        KV("edgespec.test.f64", F64, 0.5),
        KV("edgespec.test.flag", BOOL, True),
        KV("edgespec.test.empty", ARRAY, (U8, [])),
    ]
    tensors = [
        Tensor("token_embd.weight", (32, len(VALID_TOKENS)), GGML_Q8_0,
               _q8_0_blocks(len(VALID_TOKENS), 1)),
        Tensor("blk.0.attn_norm.weight", (32,), GGML_F32,
               struct.pack("<32f", *[1.0 + i / 64 for i in range(32)])),
        Tensor("output.weight", (64, 3), GGML_Q8_0, _q8_0_blocks(6, 5)),
    ]
    return Spec(kvs=kvs, tensors=tensors)


def write_valid(path: str | os.PathLike) -> Path:
    """Write the valid corpus model to ``path``."""
    data, _ = serialize(valid_spec())
    p = Path(path)
    p.write_bytes(data)
    return p


# ---- mutations -----------------------------------------------------------------------------
# Each mutation returns the bytes of a hostile file (or None for paths that are not files) and
# the text the reader's problem must contain.


def _edit_spec(edit: Callable[[Spec], None]) -> bytes:
    spec = valid_spec()
    edit(spec)
    return serialize(spec)[0]


def _patch(at: Callable[[Layout], int], fmt: str, *values: Any) -> bytes:
    """Overwrite bytes of the valid file at a layout position with packed values."""
    data, lay = serialize(valid_spec())
    pos = at(lay)
    packed = struct.pack(fmt, *values)
    return data[:pos] + packed + data[pos + len(packed):]


def _truncate(at: Callable[[Layout], int]) -> bytes:
    data, lay = serialize(valid_spec())
    return data[:at(lay)]


def _kv(spec: Spec, key: str) -> KV:
    return next(kv for kv in spec.kvs if kv.key == key)


def _set_kv(key: str, **changes: Any) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        i = spec.kvs.index(_kv(spec, key))
        spec.kvs[i] = replace(spec.kvs[i], **changes)
    return edit


def _set_tensor(index: int, **changes: Any) -> Callable[[Spec], None]:
    def edit(spec: Spec) -> None:
        spec.tensors[index] = replace(spec.tensors[index], **changes)
    return edit


def _add_kv(kv: KV) -> Callable[[Spec], None]:
    return lambda spec: spec.kvs.append(kv)


def _tokens_string_at(lay: Layout, index: int) -> int:
    """Offset of the length of token ``index`` in the tokens array."""
    pos = lay.value_at["tokenizer.ggml.tokens"] + 4 + 8
    for tok in VALID_TOKENS[:index]:
        pos += 8 + len(tok.encode())
    return pos


def _gap_before_last(spec: Spec) -> None:
    """Leave one alignment unit unused before the last tensor (no overlap, but not packed)."""
    cursor = 0
    for t in spec.tensors:
        t.offset = cursor
        cursor = _pad(cursor + len(t.data), spec.alignment)
    spec.tensors[-1].offset += spec.alignment


def _overlap(spec: Spec) -> None:
    """Point the F32 norm weight into the middle of the embedding's data."""
    spec.tensors[1].offset = 64


MUTATIONS: dict[str, tuple[Callable[[], bytes | None], str]] = {
    "bad_magic": (lambda: _edit_spec(lambda s: setattr(s, "magic", b"GGML")),
                  "bad magic b'GGML' (expected b'GGUF')"),
    "zero_magic": (lambda: _edit_spec(lambda s: setattr(s, "magic", b"\0\0\0\0")), "bad magic"),
    "version_0": (lambda: _edit_spec(lambda s: setattr(s, "version", 0)),
                  "unsupported GGUF version 0"),
    "version_1": (lambda: _edit_spec(lambda s: setattr(s, "version", 1)),
                  "GGUF version 1 is no longer supported"),
    "version_99": (lambda: _edit_spec(lambda s: setattr(s, "version", 99)),
                   "unsupported GGUF version 99"),
    "version_byteswapped": (lambda: _edit_spec(lambda s: setattr(s, "version", 3 << 24)),
                            "big-endian GGUF is not supported"),
    "empty_file": (lambda: b"", "file is empty"),
    "truncated_magic": (lambda: _truncate(lambda lay: 3), "too short for a GGUF header"),
    "truncated_mid_header": (lambda: _truncate(lambda lay: lay.n_kv_at + 3),
                             "too short for a GGUF header"),
    "truncated_after_header": (lambda: _truncate(lambda lay: lay.n_kv_at + 8),
                               "tensor count 3 cannot fit in 0 bytes"),
    # Cut so early that the declared counts alone cannot fit in what is left.
    "truncated_in_first_kv": (lambda: _truncate(lambda lay: lay.kv_at["general.name"] + 10),
                              "tensor count 3 cannot fit in"),
    "truncated_mid_key": (lambda: _truncate(lambda lay: lay.kv_at["edgespec.test.u16"] + 10),
                          "(key of key-value pair 17) has length 17 past the end of the file"),
    "truncated_mid_scalar": (lambda: _truncate(lambda lay: lay.value_at["edgespec.test.u64"] + 3),
                             "value of 'edgespec.test.u64' at offset"),
    "truncated_mid_string_value": (
        lambda: _truncate(lambda lay: lay.value_at["tokenizer.chat_template"] + 20),
        "(value of 'tokenizer.chat_template') has length"),
    "truncated_mid_token_array": (
        lambda: _truncate(lambda lay: _tokens_string_at(lay, 5) + 4),
        "past the end of the file"),
    "truncated_mid_tensor_info": (
        lambda: _truncate(lambda lay: lay.tensor_info_at["output.weight"] + 30),
        "dimension 0 of tensor 'output.weight' at offset"),
    "truncated_in_padding": (lambda: _truncate(lambda lay: lay.header_end + 1),
                             "data section starts at offset"),
    "truncated_mid_data": (lambda: _truncate(lambda lay: lay.tensor_data_at["output.weight"] + 7),
                           "tensor 'output.weight' data ["),
    "huge_kv_count": (lambda: _patch(lambda lay: lay.n_kv_at, "<Q", BIG),
                      f"key-value count {BIG} cannot fit in"),
    "huge_tensor_count": (lambda: _patch(lambda lay: lay.n_tensors_at, "<Q", BIG),
                          f"tensor count {BIG} cannot fit in"),
    "max_u64_counts": (lambda: _patch(lambda lay: lay.n_tensors_at, "<QQ", 2**64 - 1, 2**64 - 1),
                       f"tensor count {2**64 - 1} cannot fit in"),
    "kv_count_too_big_for_file": (lambda: _patch(lambda lay: lay.n_kv_at, "<Q", 1000),
                                  "key-value count 1000"),
    "huge_string_length": (lambda: _patch(lambda lay: lay.value_at["general.name"], "<Q", 2**62),
                           f"has length {2**62} past the end of the file"),
    "huge_key_length": (lambda: _patch(lambda lay: lay.kv_at["general.name"], "<Q", BIG),
                        f"has length {BIG} past the end of the file"),
    "huge_token_length": (lambda: _patch(lambda lay: _tokens_string_at(lay, 3), "<Q", 2**40),
                          f"has length {2**40} past the end of the file"),
    "huge_array_length": (
        lambda: _patch(lambda lay: lay.value_at["tokenizer.ggml.tokens"] + 4, "<Q", 2**62),
        f"has {2**62} elements"),
    "huge_numeric_array_length": (
        lambda: _patch(lambda lay: lay.value_at["tokenizer.ggml.scores"] + 4, "<Q", BIG),
        f"has {BIG} elements"),
    "nested_array": (lambda: _edit_spec(_add_kv(KV("edgespec.nested", ARRAY,
                                                   (ARRAY, [(U8, [1, 2]), (U8, [3])])))),
                     "nested array"),
    "unknown_value_type": (lambda: _edit_spec(_add_kv(KV("edgespec.odd", 99, raw=b"\0" * 8))),
                           "unknown value type 99"),
    "unknown_array_element_type": (
        lambda: _edit_spec(_add_kv(KV("edgespec.odd", ARRAY, raw=struct.pack("<IQ", 13, 1)))),
        "array of unknown value type 13"),
    "unknown_ggml_type": (lambda: _edit_spec(_set_tensor(1, ggml_type=1000)),
                          "unknown ggml type 1000"),
    "removed_ggml_type": (lambda: _edit_spec(_set_tensor(1, ggml_type=4)),  # was Q4_2
                          "unknown ggml type 4"),
    "n_dims_0": (lambda: _edit_spec(_set_tensor(1, shape=())), "has n_dims 0"),
    "n_dims_5": (lambda: _edit_spec(_set_tensor(1, shape=(2, 2, 2, 2, 2))), "has n_dims 5"),
    "zero_dim": (lambda: _edit_spec(_set_tensor(0, shape=(32, 0))), "dimension 1 is 0"),
    "negative_dim": (lambda: _edit_spec(_set_tensor(1, shape=(2**64 - 32,))),
                     "dimension 0 is 18446744073709551584, more than 2^63-1"),
    "dims_overflow": (lambda: _edit_spec(_set_tensor(1, shape=(2**32, 2**32, 2))),
                      "more than 2^63-1"),
    "row_not_whole_blocks": (lambda: _edit_spec(_set_tensor(0, shape=(33, 5))),
                             "not a multiple of the block size 32"),
    "misaligned_tensor_offset": (lambda: _edit_spec(_set_tensor(2, offset=448 + 1)),
                                 "data offset 449 is not a multiple of the alignment 64"),
    "tensor_past_end": (lambda: _edit_spec(_set_tensor(2, shape=(64, 3000))),
                        "tensor 'output.weight' data ["),
    "tensor_offset_huge": (lambda: _edit_spec(_set_tensor(2, offset=2**63)),
                           "runs past the end of the file"),
    "overlapping_tensors": (lambda: _edit_spec(_overlap), "overlaps tensor 'token_embd.weight'"),
    "same_offset_tensors": (lambda: _edit_spec(_set_tensor(2, offset=0)),
                            "overlaps tensor"),
    "tensor_gap": (lambda: _edit_spec(_gap_before_last), "but llama.cpp expects"),
    "duplicate_tensor_name": (lambda: _edit_spec(_set_tensor(2, name="token_embd.weight")),
                              "duplicate tensor name 'token_embd.weight'"),
    "tensor_name_too_long": (lambda: _edit_spec(_set_tensor(1, name="x" * 64)), "is too long"),
    "invalid_utf8_tensor_name": (lambda: _edit_spec(_set_tensor(1, name=b"blk.\xff.w")),
                                 "not valid UTF-8"),
    "duplicate_key": (lambda: _edit_spec(_add_kv(KV("general.name", STRING, "again"))),
                      "duplicate key 'general.name'"),
    "empty_key": (lambda: _edit_spec(_add_kv(KV("", U8, 1))), "empty key"),
    "alignment_0": (lambda: _edit_spec(_set_kv("general.alignment", value=0)),
                    "alignment 0 is not a power of two"),
    "alignment_3": (lambda: _edit_spec(_set_kv("general.alignment", value=3)),
                    "alignment 3 is not a power of two"),
    "alignment_wrong_type": (lambda: _edit_spec(_set_kv("general.alignment", vtype=U64)),
                             "general.alignment must be uint32, not uint64"),
    "invalid_utf8_key": (lambda: _edit_spec(_add_kv(KV(b"general.\xc3\x28", U8, 1))),
                         "not valid UTF-8"),
    "invalid_utf8_value": (lambda: _edit_spec(_set_kv("general.name", value=b"bad \xed\xa0\x80")),
                           "not valid UTF-8"),
}


def _special_paths(dirpath: Path) -> dict[str, tuple[Path, str]]:
    """Paths that are not GGUF files at all."""
    out = {}
    d = dirpath / "a_directory.gguf"
    d.mkdir(exist_ok=True)
    out["directory"] = (d, "is a directory")
    out["missing"] = (dirpath / "does-not-exist.gguf", "no such file")
    if hasattr(os, "mkfifo"):
        fifo = dirpath / "a_fifo.gguf"
        if not fifo.exists():
            os.mkfifo(fifo)
        out["fifo"] = (fifo, "not a regular file")  # opening it would block forever
    return out


def build_corpus(dirpath: str | os.PathLike) -> dict[str, tuple[Path, str]]:
    """Write every hostile variant into ``dirpath``; return name -> (path, expected problem)."""
    root = Path(dirpath)
    root.mkdir(parents=True, exist_ok=True)
    corpus: dict[str, tuple[Path, str]] = {}
    for name, (make, expected) in MUTATIONS.items():
        path = root / f"{name}.gguf"
        path.write_bytes(make())
        corpus[name] = (path, expected)
    corpus.update(_special_paths(root))
    return corpus


if __name__ == "__main__":  # to look at the files: python tests/gguf_corpus.py DIR
    import sys

    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "gguf-corpus")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{'valid':32} {write_valid(out_dir / 'valid.gguf')}")
    for case, (p, problem) in build_corpus(out_dir).items():
        print(f"{case:32} {p}  expects: {problem}")


# ---- hyperparameters llama.cpp aborts on ----------------------------------------------------
# Well-formed files whose hyperparameters break a GGML_ASSERT of llama.cpp's load_hparams or of
# an architecture's graph: llama.cpp would abort the process (exit 134) instead of failing the load.


def _as_arch(arch: str) -> Callable[[Spec], None]:
    """Rename the valid model's `llama.*` keys to another architecture's."""
    def edit(spec: Spec) -> None:
        for i, kv in enumerate(spec.kvs):
            if kv.key == "general.architecture":
                spec.kvs[i] = replace(kv, value=arch)
            elif isinstance(kv.key, str) and kv.key.startswith("llama."):
                spec.kvs[i] = replace(kv, key=arch + kv.key[len("llama"):])
    return edit


def _hparams(*edits: Callable[[Spec], None], **values: Any) -> Callable[[], bytes]:
    """The valid model after ``edits``, with `{arch}.<key>` set (added if absent) per ``values``:
    an int is written as uint32 (what llama.cpp reads), a str as a string, a list as a uint32 array."""
    def make() -> bytes:
        spec = valid_spec()
        for edit in edits:
            edit(spec)
        arch = _kv(spec, "general.architecture").value
        for suffix, v in values.items():
            key = f"{arch}.{suffix.replace('__', '.')}"
            new = (KV(key, STRING, v) if isinstance(v, str) else
                   KV(key, ARRAY, (U32, v)) if isinstance(v, list) else KV(key, U32, v))
            spec.kvs = [kv for kv in spec.kvs if kv.key != key] + [new]
        return serialize(spec)[0]
    return make


#: name -> (bytes maker, text the refusal must contain); the valid model has 1 layer,
#: embedding_length 32, 4 heads and 2 KV heads.
HPARAM_MUTATIONS: dict[str, tuple[Callable[[], bytes], str]] = {
    "block_count_0": (_hparams(block_count=0), "llama.block_count is 0"),
    "block_count_513": (_hparams(block_count=513), "llama.block_count is 513"),
    "block_count_u32_max": (_hparams(block_count=2**32 - 1), f"llama.block_count is {2**32 - 1}"),
    "nextn_over_layers": (_hparams(nextn_predict_layers=2), "llama.nextn_predict_layers is 2"),
    "expert_count_1000_none_used": (_hparams(expert_count=1000), "llama.expert_used_count is 0"),
    "expert_count_1025": (_hparams(expert_count=1025, expert_used_count=2),
                          "llama.expert_count is 1025"),
    "expert_used_over_count": (_hparams(expert_count=8, expert_used_count=9),
                               "llama.expert_used_count is 9"),
    "expert_used_array_over_count": (_hparams(expert_count=8, expert_used_count=[9]),
                                     "llama.expert_used_count is 9"),
    "expert_used_without_experts": (_hparams(expert_used_count=2),
                                    "llama.expert_used_count is 2"),
    "expert_groups_without_experts": (_hparams(expert_group_count=2),
                                      "llama.expert_group_count is 2"),
    "expert_groups_not_dividing": (_hparams(expert_count=8, expert_used_count=2,
                                            expert_group_count=3),
                                   "llama.expert_group_count is 3"),
    "expert_groups_all_experts": (_hparams(expert_count=8, expert_used_count=2,
                                           expert_group_count=8),
                                  "llama.expert_group_count is 8"),
    "expert_group_used_0": (_hparams(expert_count=8, expert_used_count=2, expert_group_count=2,
                                     expert_group_used_count=0),
                            "llama.expert_group_used_count is 0"),
    "rope_scaling_unknown": (_hparams(rope__scaling__type="bogus"),
                             "llama.rope.scaling.type is 'bogus'"),
    "head_array_too_long": (_hparams(attention__head_count=[4] * 513),
                            "llama.attention.head_count is an array of 513 values"),
    "head_count_0": (_hparams(attention__head_count=0), "llama.attention.head_count is 0"),
    "head_count_kv_0": (_hparams(attention__head_count_kv=0),
                        "llama.attention.head_count_kv is 0"),
    "head_count_kv_not_dividing": (_hparams(attention__head_count_kv=3),
                                   "llama.attention.head_count_kv is 3"),
    "value_length_not_key_length": (_hparams(attention__key_length=8,
                                             attention__value_length=16),
                                    "llama.attention.value_length is 16"),
    "rope_dims_not_head_size": (_hparams(rope__dimension_count=4),
                                "llama.rope.dimension_count is 4"),
    "qwen2_embedding_not_heads": (_hparams(_as_arch("qwen2"), embedding_length=30),
                                  "qwen2.embedding_length is 30"),
    "qwen2_block_count_0": (_hparams(_as_arch("qwen2"), block_count=0),
                            "qwen2.block_count is 0"),
    "gemma3_head_count_0": (_hparams(_as_arch("gemma3"), attention__head_count=0),
                            "gemma3.attention.head_count is 0"),
    "vocoder_posnet_over_layers": (_hparams(_as_arch("wavtokenizer-dec"), posnet__block_count=2),
                                   "wavtokenizer-dec.posnet.block_count is 2"),
    "unknown_arch_block_count_0": (_hparams(_as_arch("someday-arch"), block_count=0),
                                   "someday-arch.block_count is 0"),
}

#: Variants near the bounds that llama.cpp loads: the checks must accept them.
HPARAM_ACCEPTED: dict[str, Callable[[], bytes]] = {
    "block_count_512": _hparams(block_count=512),
    "moe_8_experts_2_used": _hparams(expert_count=8, expert_used_count=2),
    "moe_1024_experts_grouped": _hparams(expert_count=1024, expert_used_count=[8],
                                         expert_group_count=8, expert_group_used_count=4),
    "rope_scaling_yarn": _hparams(rope__scaling__type="yarn"),
    "head_count_per_layer": _hparams(attention__head_count=[4], attention__head_count_kv=[1]),
    "gemma3_wide_heads": _hparams(_as_arch("gemma3"), attention__key_length=256,
                                  attention__value_length=256),
    # hunyuan-dense treats a single expert as none (llama-model.cpp:1337)
    "hunyuan_one_expert": _hparams(_as_arch("hunyuan-dense"), expert_count=1, expert_used_count=2),
}


def build_hparam_corpus(dirpath: str | os.PathLike) -> dict[str, tuple[Path, str]]:
    """Write every HPARAM_MUTATIONS file into ``dirpath``; return name -> (path, expected text)."""
    root = Path(dirpath)
    root.mkdir(parents=True, exist_ok=True)
    corpus = {}
    for name, (make, expected) in HPARAM_MUTATIONS.items():
        path = root / f"{name}.gguf"
        path.write_bytes(make())
        corpus[name] = (path, expected)
    return corpus
