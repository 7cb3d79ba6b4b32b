"""Structural validation of a GGUF header: counts, keys, alignment and the tensor table.

Layout of a GGUF file (versions 2 and 3, little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 dim | u32 ggml type | u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor's offset is relative to the start of this section

Every count is checked against the bytes left before it is looped over, and the first problem
ends parsing in one :class:`~edgespec.errors.InvalidGGUF` whose message names it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from edgespec.files.gguf_reader import GGUF_TYPE_UINT32, VALUE_TYPES, Reader, decode_value

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: ggml's GGML_MAX_DIMS: tensors have 1 to 4 dimensions.
MAX_DIMS = 4
#: ggml's GGML_MAX_NAME is 64 including the terminating NUL: llama.cpp refuses longer names.
MAX_TENSOR_NAME = 63
INT64_MAX = 2**63 - 1

_HEADER = struct.Struct("<4sIQQ")  # magic, version, n_tensors, n_kv

# Smallest possible encodings, used to refuse absurd counts by arithmetic alone.
# A key-value pair: key length (8) + a non-empty key (1) + value type (4) + a 1-byte value.
_MIN_KV_BYTES = 8 + 1 + 4 + 1
# A tensor info: name length (8) + n_dims (4) + one dimension (8) + type (4) + offset (8).
# (Names may be empty, so they add nothing.)
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

_QK_K = 256
#: Every ggml tensor type llama.cpp can load: id -> (name, elements per block, bytes per block).
#: Ids 4, 5, 31-33 and 36-38 were removed from ggml and are refused, as llama.cpp does.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 2 + 2 + 32),
    10: ("Q2_K", _QK_K, 2 + 2 + _QK_K // 16 + _QK_K // 4),
    11: ("Q3_K", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    12: ("Q4_K", _QK_K, 2 + 2 + _QK_K // 2 + 12),
    13: ("Q5_K", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 8 + 12),
    14: ("Q6_K", _QK_K, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16),
    15: ("Q8_K", _QK_K, 4 + _QK_K + _QK_K // 8),
    16: ("IQ2_XXS", _QK_K, 2 + _QK_K // 4),
    17: ("IQ2_XS", _QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    18: ("IQ3_XXS", _QK_K, 2 + _QK_K // 4 + _QK_K // 8),
    19: ("IQ1_S", _QK_K, 2 + _QK_K // 8 + _QK_K // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    22: ("IQ2_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    23: ("IQ4_XS", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", _QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", _QK_K, 2 + 4 * 13),
    35: ("TQ2_0", _QK_K, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
    40: ("NVFP4", 64, 4 + 32),
    41: ("Q1_0", 128, 2 + 16),
    42: ("Q2_0", 64, 2 + 16),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, as its header describes it.

    ``shape`` is in ggml order: ``shape[0]`` is the length of a row (the innermost,
    contiguous dimension), the reverse of numpy/PyTorch order.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        """Number of elements (weights) of the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def _read_header(r: Reader) -> tuple[int, int, int]:
    """Check magic, version and the two counts; return (version, n_tensors, n_kv)."""
    if r.size == 0:
        r.fail("file is empty")
    if r.size < _HEADER.size:
        r.fail(f"file is {r.size} bytes, too short for a GGUF header ({_HEADER.size} bytes)")
    magic, version, n_tensors, n_kv = _HEADER.unpack_from(r.buf, 0)
    r.pos = _HEADER.size
    if magic != GGUF_MAGIC:
        r.fail(f"bad magic {magic!r} (expected {GGUF_MAGIC!r})")
    _check_version(r, version)
    room = r.remaining()
    if n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        r.fail(f"tensor count {n_tensors} cannot fit in {room} bytes")
    if n_kv * _MIN_KV_BYTES > room:
        r.fail(f"key-value count {n_kv} cannot fit in {room} bytes")
    if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > room:
        r.fail(f"key-value count {n_kv} and tensor count {n_tensors} together cannot fit in "
               f"{room} bytes")
    return version, n_tensors, n_kv


def _check_version(r: Reader, version: int) -> None:
    """Accept GGUF v2 and v3; explain the other values one meets in practice."""
    if version in SUPPORTED_VERSIONS:
        return
    if version == 1:
        r.fail("GGUF version 1 is no longer supported (llama.cpp reads versions 2 and 3)")
    # A small version read with the wrong byte order has its low 16 bits zero.
    if version != 0 and version & 0xFFFF == 0:
        r.fail(f"big-endian GGUF is not supported (version field reads {version:#010x})")
    r.fail(f"unsupported GGUF version {version} (supported: 2, 3)")


def _read_metadata(r: Reader, n_kv: int,
                   spans: dict[str, tuple[int, int]] | None = None
                   ) -> tuple[dict[str, Any], dict[str, int]]:
    """Read the key-value pairs; return (values by key, GGUF value type by key).

    ``spans``, when given, receives each pair's [start, end) byte range in the file.
    """
    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        start = r.pos
        key = r.text(f"key of key-value pair {i}")
        if not key:
            r.fail(f"key-value pair {i} has an empty key")
        if key in metadata:
            r.fail(f"duplicate key {key!r} (key-value pair {i})")
        vtype = r.u32(f"value type of {key!r}")
        metadata[key] = decode_value(r, vtype, f"value of {key!r}")
        types[key] = vtype
        if spans is not None:
            spans[key] = (start, r.pos)
    return metadata, types


def _alignment(r: Reader, metadata: dict[str, Any], types: dict[str, int]) -> int:
    """The data alignment: `general.alignment`, a power of two stored as u32, or 32."""
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    if types["general.alignment"] != GGUF_TYPE_UINT32:
        tname = VALUE_TYPES[types["general.alignment"]][0]
        r.fail(f"general.alignment must be uint32, not {tname}")
    alignment = metadata["general.alignment"]
    if alignment == 0 or alignment & (alignment - 1):
        r.fail(f"alignment {alignment} is not a power of two")
    return alignment


@dataclass(frozen=True)
class RawTensor:
    """A tensor info as read, before its offset is placed in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    rel_offset: int
    nbytes: int


def _read_tensor_info(r: Reader, i: int) -> RawTensor:
    """Read and check one tensor info: name, shape, type and size."""
    name = r.text(f"name of tensor {i}")
    if len(name.encode("utf-8")) > MAX_TENSOR_NAME:
        r.fail(f"tensor {i} name {name[:80]!r} is too long ({len(name.encode())} bytes, "
               f"llama.cpp allows at most {MAX_TENSOR_NAME})")
    n_dims = r.u32(f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        r.fail(f"tensor {name!r} has n_dims {n_dims} (must be 1..{MAX_DIMS})")
    shape = tuple(r.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
    n_elements = _check_shape(r, name, shape)
    ggml_type = r.u32(f"type of tensor {name!r}")
    nbytes = _tensor_nbytes(r, name, shape, n_elements, ggml_type)
    rel_offset = r.u64(f"data offset of tensor {name!r}")
    return RawTensor(name, shape, ggml_type, rel_offset, nbytes)


def _check_shape(r: Reader, name: str, shape: tuple[int, ...]) -> int:
    """Dimensions must be positive and their product fit ggml's int64; return the product."""
    n = 1
    for d, dim in enumerate(shape):
        if dim == 0:
            r.fail(f"tensor {name!r} dimension {d} is 0")
        if dim > INT64_MAX:
            r.fail(f"tensor {name!r} dimension {d} is {dim}, more than 2^63-1")
        n *= dim
    if n > INT64_MAX:
        r.fail(f"tensor {name!r} shape {list(shape)} has {n} elements, more than 2^63-1")
    return n


def _tensor_nbytes(r: Reader, name: str, shape: tuple[int, ...], n_elements: int,
                   ggml_type: int) -> int:
    """Size of a tensor's data; the type must be known and rows whole blocks."""
    spec = GGML_TYPES.get(ggml_type)
    if spec is None:
        r.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
    tname, block, type_size = spec
    if shape[0] % block:
        r.fail(f"tensor {name!r} of type {tname} has rows of {shape[0]} elements, not a "
               f"multiple of the block size {block}")
    return n_elements // block * type_size


def place_tensors(r: Reader, raw: list[RawTensor], data_offset: int,
                  alignment: int) -> tuple[TensorInfo, ...]:
    """Check every tensor's data lies aligned inside the file; return them with absolute offsets."""
    tensors = []
    for t in raw:
        if t.rel_offset % alignment:
            r.fail(f"tensor {t.name!r} data offset {t.rel_offset} is not a multiple of the "
                   f"alignment {alignment}")
        start = data_offset + t.rel_offset
        end = start + t.nbytes
        if end > r.size:
            r.fail(f"tensor {t.name!r} data [{start}, {end}) runs past the end of the file "
                   f"({r.size} bytes)")
        tname = GGML_TYPES[t.ggml_type][0]
        tensors.append(TensorInfo(t.name, t.shape, t.ggml_type, tname, start, t.nbytes))
    _check_no_overlap(r, tensors)
    check_packed(r, raw, alignment)
    return tuple(tensors)


def _check_no_overlap(r: Reader, tensors: list[TensorInfo]) -> None:
    """No two tensors may share bytes (a hostile file could alias weights)."""
    last: TensorInfo | None = None  # the tensor reaching furthest so far
    for t in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        if last is not None and t.offset < last.offset + last.nbytes:
            r.fail(f"tensor {t.name!r} data [{t.offset}, {t.offset + t.nbytes}) overlaps "
                   f"tensor {last.name!r} data [{last.offset}, {last.offset + last.nbytes})")
        if last is None or t.offset + t.nbytes > last.offset + last.nbytes:
            last = t


def check_packed(r: Reader, raw: list[RawTensor], alignment: int) -> None:
    """llama.cpp's loader demands tensors stored in header order, each padded to the alignment.

    Checking it here turns llama.cpp's terse refusal into a clear one.
    """
    expected = 0
    for t in raw:
        if t.rel_offset != expected:
            r.fail(f"tensor {t.name!r} has data offset {t.rel_offset} but llama.cpp expects "
                   f"{expected} (tensors stored in header order, each padded to {alignment} "
                   f"bytes)")
        expected += _pad(t.nbytes, alignment)


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def parse_infos(r: Reader, spans: dict[str, tuple[int, int]] | None = None
                ) -> tuple[int, dict[str, Any], int, list[RawTensor], int]:
    """Parse everything before the tensor data: (version, metadata, alignment, tensors,
    data_offset); the data section itself need not be in the file."""
    version, n_tensors, n_kv = _read_header(r)
    metadata, types = _read_metadata(r, n_kv, spans)
    alignment = _alignment(r, metadata, types)
    raw: list[RawTensor] = []
    names: set[str] = set()
    for i in range(n_tensors):
        t = _read_tensor_info(r, i)
        if t.name in names:
            r.fail(f"duplicate tensor name {t.name!r} (tensor {i})")
        names.add(t.name)
        raw.append(t)
    # As in llama.cpp, the data section is padded to the alignment only when there is data.
    data_offset = _pad(r.pos, alignment) if raw else r.pos
    return version, metadata, alignment, raw, data_offset
