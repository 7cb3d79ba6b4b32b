"""A pure-Python reader and validator of GGUF model files.

llama.cpp trusts much of a GGUF header: a corrupt or hostile file can make it abort, allocate
gigabytes or read past a mapping.  Before any file reaches llama.cpp, :func:`read_gguf` parses
the header here, in bounded Python: every count and length is checked against the bytes left in
the file *before* anything is allocated or looped over, so a bad file costs a few microseconds
and a few kilobytes, and ends in one :class:`~edgespec.errors.InvalidGGUF` whose message names
the file and the exact problem.

Layout of a GGUF file (versions 2 and 3, little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 dim | u32 ggml type | u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor's offset is relative to the start of this section

A string is a u64 byte length followed by that many UTF-8 bytes; an array is a u32 element
type, a u64 count and the elements.

:func:`model_info` summarises a validated file (architecture, size, quantisation, tokenizer),
and :func:`tokenizer_fingerprint` gives a short hash that is equal for two models exactly when
their vocabularies are, which speculative decoding needs of a draft and a target model.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import mmap
import os
import stat
import struct
from dataclasses import asdict, dataclass
from typing import Any, Callable, NoReturn

from edgespec.errors import InvalidGGUF

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: ggml's GGML_MAX_DIMS: tensors have 1 to 4 dimensions.
MAX_DIMS = 4
#: ggml's GGML_MAX_NAME is 64 including the terminating NUL: llama.cpp refuses longer names.
MAX_TENSOR_NAME = 63
#: llama.cpp refuses arrays of arrays, so one level of array is all a usable file can have.
MAX_ARRAY_DEPTH = 1
#: Bounds on what decoding metadata may allocate, whatever the file size.  Real models stay
#: far below them (vocabularies have up to ~260k tokens, chat templates are kilobytes), while
#: a hostile file of a few hundred MB can otherwise make a Python list cost gigabytes.
MAX_STRING_LENGTH = 64 * 1024 * 1024
MAX_ARRAY_ELEMENTS_TOTAL = 8 * 1024 * 1024
INT64_MAX = 2**63 - 1

_HEADER = struct.Struct("<4sIQQ")  # magic, version, n_tensors, n_kv
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# GGUF metadata value types: id -> (name, struct format of one element, size in bytes).
# STRING and ARRAY have variable size; the size given is their smallest encoding.
GGUF_TYPE_STRING = 8
GGUF_TYPE_ARRAY = 9
_VALUE_TYPES: dict[int, tuple[str, str, int]] = {
    0: ("uint8", "B", 1),
    1: ("int8", "b", 1),
    2: ("uint16", "H", 2),
    3: ("int16", "h", 2),
    4: ("uint32", "I", 4),
    5: ("int32", "i", 4),
    6: ("float32", "f", 4),
    7: ("bool", "?", 1),
    GGUF_TYPE_STRING: ("string", "", 8),
    GGUF_TYPE_ARRAY: ("array", "", 4 + 8),
    10: ("uint64", "Q", 8),
    11: ("int64", "q", 8),
    12: ("float64", "d", 8),
}
_GGUF_TYPE_UINT32 = 4

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

#: llama.cpp's llama_ftype (the `general.file_type` key) -> the usual quantisation name.
LLAMA_FTYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    4: "Q4_1_SOME_F16",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
    41: "Q2_0",
}
_LLAMA_FTYPE_GUESSED = 1024


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


@dataclass(frozen=True)
class GGUFFile:
    """A parsed and validated GGUF header."""

    path: str
    version: int
    alignment: int
    data_offset: int  # absolute offset of the tensor data section
    file_size: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


class _Reader:
    """Bounded, position-tracking reads over a buffer (an mmap of the file).

    Every read first checks that the bytes it needs are there, so that no value read from the
    file can make it index, allocate or loop beyond the file's size.
    """

    def __init__(self, path: str, buf: Any, size: int):
        self.path = path
        self.buf = buf
        self.size = size
        self.pos = 0
        self.array_elements = 0  # total decoded so far, bounded by MAX_ARRAY_ELEMENTS_TOTAL

    def fail(self, problem: str) -> NoReturn:
        """Abort parsing with a one-line description of the problem."""
        raise InvalidGGUF(self.path, problem)

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        """Refuse to read ``n`` bytes of ``what`` unless they are all in the file."""
        if n > self.size - self.pos:
            self.fail(f"{what} at offset {self.pos} ({n} bytes) runs past the end of the file "
                      f"({self.size} bytes)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        """Read a length-prefixed string's bytes, checking the length before slicing."""
        start = self.pos
        n = self.u64(f"length of {what}")
        if n > self.size - self.pos:
            self.fail(f"string at offset {start} ({what}) has length {n} past the end of the "
                      f"file ({self.size} bytes)")
        if n > MAX_STRING_LENGTH:
            self.fail(f"string at offset {start} ({what}) has length {n}, more than the "
                      f"{MAX_STRING_LENGTH} bytes allowed")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def text(self, what: str) -> str:
        """Read a string that must be valid UTF-8 (keys, names, scalar values)."""
        start = self.pos
        b = self.raw_string(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"string at offset {start} ({what}) is not valid UTF-8: {e.reason} at "
                      f"byte {e.start} of {b[:40]!r}")


def _decode_value(r: _Reader, vtype: int, what: str, depth: int = 0) -> Any:
    """Decode one metadata value of GGUF type ``vtype``."""
    if vtype == GGUF_TYPE_STRING:
        return r.text(what)
    if vtype == GGUF_TYPE_ARRAY:
        return _decode_array(r, what, depth + 1)
    spec = _VALUE_TYPES.get(vtype)
    if spec is None:
        r.fail(f"{what} has unknown value type {vtype}")
    _, fmt, size = spec
    r.need(size, what)
    (v,) = struct.unpack_from("<" + fmt, r.buf, r.pos)
    r.pos += size
    return v


def _decode_array(r: _Reader, what: str, depth: int) -> list:
    """Decode an array value after checking its element count against the bytes left."""
    if depth > MAX_ARRAY_DEPTH:
        r.fail(f"{what} is a nested array (array of arrays), which llama.cpp does not support")
    start = r.pos
    etype = r.u32(f"element type of {what}")
    spec = _VALUE_TYPES.get(etype)
    if spec is None:
        r.fail(f"{what} is an array of unknown value type {etype}")
    if etype == GGUF_TYPE_ARRAY:
        r.fail(f"{what} is a nested array (array of arrays), which llama.cpp does not support")
    n = r.u64(f"element count of {what}")
    min_size = spec[2]
    if n * min_size > r.remaining():
        r.fail(f"array at offset {start} ({what}) has {n} elements of at least {min_size} "
               f"bytes, past the end of the file ({r.size} bytes)")
    r.array_elements += n
    if r.array_elements > MAX_ARRAY_ELEMENTS_TOTAL:
        r.fail(f"array at offset {start} ({what}) has {n} elements, more than the "
               f"{MAX_ARRAY_ELEMENTS_TOTAL} array elements allowed in all metadata")
    if etype == GGUF_TYPE_STRING:
        return _decode_string_array(r, n, what)
    fmt = spec[1]
    values = list(struct.unpack_from(f"<{n}{fmt}", r.buf, r.pos))
    r.pos += n * min_size
    return values


def _decode_string_array(r: _Reader, n: int, what: str) -> list[str]:
    """Decode ``n`` strings; the hot loop for vocabularies of 150k+ tokens.

    Token strings are byte sequences that need not be valid UTF-8 (byte-level BPE pieces can
    split a character), so they are decoded with ``surrogateescape``: the exact bytes come back
    with ``s.encode("utf-8", "surrogateescape")``.
    """
    buf, size, pos = r.buf, r.size, r.pos
    unpack = _U64.unpack_from
    out: list[str] = []
    append = out.append
    for i in range(n):
        if pos + 8 > size:
            r.pos = pos
            r.need(8, f"length of element {i} of {what}")
        (length,) = unpack(buf, pos)
        pos += 8
        if length > size - pos or length > MAX_STRING_LENGTH:
            r.pos = pos - 8
            r.raw_string(f"element {i} of {what}")  # raises with the precise message
        append(buf[pos:pos + length].decode("utf-8", "surrogateescape"))
        pos += length
    r.pos = pos
    return out


def _read_header(r: _Reader) -> tuple[int, int, int]:
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


def _check_version(r: _Reader, version: int) -> None:
    """Accept GGUF v2 and v3; explain the other values one meets in practice."""
    if version in SUPPORTED_VERSIONS:
        return
    if version == 1:
        r.fail("GGUF version 1 is no longer supported (llama.cpp reads versions 2 and 3)")
    # A small version read with the wrong byte order has its low 16 bits zero.
    if version != 0 and version & 0xFFFF == 0:
        r.fail(f"big-endian GGUF is not supported (version field reads {version:#010x})")
    r.fail(f"unsupported GGUF version {version} (supported: 2, 3)")


def _read_metadata(r: _Reader, n_kv: int,
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
        metadata[key] = _decode_value(r, vtype, f"value of {key!r}")
        types[key] = vtype
        if spans is not None:
            spans[key] = (start, r.pos)
    return metadata, types


def _alignment(r: _Reader, metadata: dict[str, Any], types: dict[str, int]) -> int:
    """The data alignment: `general.alignment`, a power of two stored as u32, or 32."""
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    if types["general.alignment"] != _GGUF_TYPE_UINT32:
        tname = _VALUE_TYPES[types["general.alignment"]][0]
        r.fail(f"general.alignment must be uint32, not {tname}")
    alignment = metadata["general.alignment"]
    if alignment == 0 or alignment & (alignment - 1):
        r.fail(f"alignment {alignment} is not a power of two")
    return alignment


@dataclass(frozen=True)
class _RawTensor:
    """A tensor info as read, before its offset is placed in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    rel_offset: int
    nbytes: int


def _read_tensor_info(r: _Reader, i: int) -> _RawTensor:
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
    return _RawTensor(name, shape, ggml_type, rel_offset, nbytes)


def _check_shape(r: _Reader, name: str, shape: tuple[int, ...]) -> int:
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


def _tensor_nbytes(r: _Reader, name: str, shape: tuple[int, ...], n_elements: int,
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


def _place_tensors(r: _Reader, raw: list[_RawTensor], data_offset: int,
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
    _check_packed(r, raw, alignment)
    return tuple(tensors)


def _check_no_overlap(r: _Reader, tensors: list[TensorInfo]) -> None:
    """No two tensors may share bytes (a hostile file could alias weights)."""
    last: TensorInfo | None = None  # the tensor reaching furthest so far
    for t in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        if last is not None and t.offset < last.offset + last.nbytes:
            r.fail(f"tensor {t.name!r} data [{t.offset}, {t.offset + t.nbytes}) overlaps "
                   f"tensor {last.name!r} data [{last.offset}, {last.offset + last.nbytes})")
        if last is None or t.offset + t.nbytes > last.offset + last.nbytes:
            last = t


def _check_packed(r: _Reader, raw: list[_RawTensor], alignment: int) -> None:
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


def _parse_infos(r: _Reader, spans: dict[str, tuple[int, int]] | None = None
                 ) -> tuple[int, dict[str, Any], int, list[_RawTensor], int]:
    """Parse everything before the tensor data: (version, metadata, alignment, tensors,
    data_offset); the data section itself need not be in the file."""
    version, n_tensors, n_kv = _read_header(r)
    metadata, types = _read_metadata(r, n_kv, spans)
    alignment = _alignment(r, metadata, types)
    raw: list[_RawTensor] = []
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


def _parse(r: _Reader) -> GGUFFile:
    """Parse a whole header from the reader; raise InvalidGGUF on the first problem."""
    version, metadata, alignment, raw, data_offset = _parse_infos(r)
    if data_offset > r.size:
        r.fail(f"data section starts at offset {data_offset}, past the end of the file "
               f"({r.size} bytes)")
    tensors = _place_tensors(r, raw, data_offset, alignment)
    return GGUFFile(r.path, version, alignment, data_offset, r.size, metadata, tensors)


def _open_checked(path: str) -> tuple[Any, int]:
    """Open a regular file for reading; refuse anything else without blocking on it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InvalidGGUF(path, "no such file") from None
    except OSError as e:
        raise InvalidGGUF(path, f"cannot stat: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InvalidGGUF(path, "is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        # Opening a FIFO or a device could block forever or read without end.
        raise InvalidGGUF(path, "not a regular file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InvalidGGUF(path, f"cannot open: {e.strerror or e}") from None
    return f, os.fstat(f.fileno()).st_size


@contextlib.contextmanager
def _mapped(path: str):
    """A _Reader over the whole file at ``path``, mapped read-only; InvalidGGUF if it cannot be."""
    f, size = _open_checked(path)
    with f:
        if size == 0:
            raise InvalidGGUF(path, "file is empty")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise InvalidGGUF(path, f"cannot map the file: {e}") from None
        try:
            yield _Reader(path, mm, size)
        finally:
            mm.close()


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate the header of the GGUF file at ``path``.

    Raises InvalidGGUF(path, problem) for anything wrong, including a missing or unreadable
    path or a directory.  The tensor data is not read, only checked to lie within the file.
    """
    path = os.fspath(path)
    with _mapped(path) as r:
        g = _parse(r)
    log.debug("read %s: GGUF v%d, %d keys, %d tensors", path, g.version, len(g.metadata),
              len(g.tensors))
    return g


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header read without its tensor data (enough to rebuild the file's shape).

    ``raw_kv`` holds each key-value pair's exact encoding (key, type, value), so a writer can
    copy metadata byte for byte whatever its value types.  Tensor offsets are absolute, as if
    the data section followed the header; a file cut after the header has none of that data.
    """

    path: str
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    raw_kv: dict[str, bytes]
    tensors: tuple[TensorInfo, ...]


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and check a GGUF header; the tensor data may be absent (a header-only file).

    Everything :func:`read_gguf` checks is checked except that the data lies in the file.
    Raises InvalidGGUF.
    """
    path = os.fspath(path)
    with _mapped(path) as r:
        spans: dict[str, tuple[int, int]] = {}
        version, metadata, alignment, raw, data_offset = _parse_infos(r, spans)
        _check_packed(r, raw, alignment)
        raw_kv = {k: r.buf[a:b] for k, (a, b) in spans.items()}
    tensors = tuple(TensorInfo(t.name, t.shape, t.ggml_type, GGML_TYPES[t.ggml_type][0],
                               data_offset + t.rel_offset, t.nbytes) for t in raw)
    return GGUFHeader(path, version, alignment, data_offset, metadata, raw_kv, tensors)


@dataclass(frozen=True)
class ModelInfo:
    """What a user or a scheduler wants to know of a model file, without loading it."""

    path: str
    architecture: str
    name: str | None
    parameters: int
    quantization: str
    context_length: int | None
    vocab_size: int
    tokenizer_model: str | None
    tokenizer_fingerprint: str
    n_layers: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    file_size: int
    chat_template: str | None

    def to_dict(self) -> dict:
        """JSON-ready fields; the chat template is replaced by ``has_chat_template``."""
        d = asdict(self)
        d["has_chat_template"] = d.pop("chat_template") is not None
        return d


def tokenizer_fingerprint(g: GGUFFile) -> str:
    """A 16-hex-digit hash of the tokenizer model and the exact bytes of every token.

    Two models can share speculative drafts only when their fingerprints are equal.
    """
    model = g.metadata.get("tokenizer.ggml.model")
    tokens = g.metadata.get("tokenizer.ggml.tokens") or []
    h = hashlib.sha256()
    h.update((model if isinstance(model, str) else "").encode("utf-8") + b"\n")
    # Tokens were decoded with surrogateescape: encoding the same way restores their bytes.
    h.update(b"\0".join(t.encode("utf-8", "surrogateescape") for t in tokens))
    return h.hexdigest()[:16]


def _quantization(g: GGUFFile) -> str:
    """The llama_ftype name of `general.file_type`, else the tensor type holding most bytes."""
    ftype = g.metadata.get("general.file_type")
    if isinstance(ftype, int) and not isinstance(ftype, bool):
        name = LLAMA_FTYPES.get(ftype & ~_LLAMA_FTYPE_GUESSED)
        if name is not None:
            return name
    by_type: collections.Counter[str] = collections.Counter()
    for t in g.tensors:
        by_type[t.type_name] += t.nbytes
    return by_type.most_common(1)[0][0] if by_type else "unknown"


def _int_or_none(value: Any) -> int | None:
    """An integer metadata value; per-layer arrays (some models vary heads by layer) give their max."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return max(value)
    return None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def model_info(path: str | os.PathLike) -> ModelInfo:
    """Validate the file at ``path`` and summarise it; raises InvalidGGUF."""
    g = read_gguf(path)
    return info_from_gguf(g)


def info_from_gguf(g: GGUFFile) -> ModelInfo:
    """Summarise an already validated GGUFFile."""
    md = g.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidGGUF(g.path, "missing general.architecture (not a model file?)")
    key: Callable[[str], Any] = lambda suffix: md.get(f"{arch}.{suffix}")  # noqa: E731
    tokens = md.get("tokenizer.ggml.tokens")
    return ModelInfo(
        path=g.path,
        architecture=arch,
        name=_str_or_none(md.get("general.name")),
        parameters=sum(t.n_elements for t in g.tensors),
        quantization=_quantization(g),
        context_length=_int_or_none(key("context_length")),
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,
        tokenizer_model=_str_or_none(md.get("tokenizer.ggml.model")),
        tokenizer_fingerprint=tokenizer_fingerprint(g),
        n_layers=_int_or_none(key("block_count")),
        embedding_length=_int_or_none(key("embedding_length")),
        head_count=_int_or_none(key("attention.head_count")),
        head_count_kv=_int_or_none(key("attention.head_count_kv")),
        file_size=g.file_size,
        chat_template=_str_or_none(md.get("tokenizer.chat_template")),
    )
