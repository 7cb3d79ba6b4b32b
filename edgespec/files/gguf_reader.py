"""Bounded reads of GGUF's binary encoding (integers, strings, metadata values) over a
read-only mapping of the file.

A string is a u64 byte length followed by that many UTF-8 bytes; an array is a u32 element
type, a u64 count and the elements.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
from typing import Any, NoReturn

from edgespec.errors import InvalidGGUF

#: llama.cpp refuses arrays of arrays, so one level of array is all a usable file can have.
MAX_ARRAY_DEPTH = 1
#: Bounds on what decoding metadata may allocate, whatever the file size.  Real models stay
#: far below them (vocabularies have up to ~260k tokens, chat templates are kilobytes), while
#: a hostile file of a few hundred MB can otherwise make a Python list cost gigabytes.
MAX_STRING_LENGTH = 64 * 1024 * 1024
MAX_ARRAY_ELEMENTS_TOTAL = 8 * 1024 * 1024

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# GGUF metadata value types: id -> (name, struct format of one element, size in bytes).
# STRING and ARRAY have variable size; the size given is their smallest encoding.
GGUF_TYPE_STRING = 8
GGUF_TYPE_ARRAY = 9
VALUE_TYPES: dict[int, tuple[str, str, int]] = {
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
GGUF_TYPE_UINT32 = 4


class Reader:
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


def decode_value(r: Reader, vtype: int, what: str, depth: int = 0) -> Any:
    """Decode one metadata value of GGUF type ``vtype``."""
    if vtype == GGUF_TYPE_STRING:
        return r.text(what)
    if vtype == GGUF_TYPE_ARRAY:
        return _decode_array(r, what, depth + 1)
    spec = VALUE_TYPES.get(vtype)
    if spec is None:
        r.fail(f"{what} has unknown value type {vtype}")
    _, fmt, size = spec
    r.need(size, what)
    (v,) = struct.unpack_from("<" + fmt, r.buf, r.pos)
    r.pos += size
    return v


def _decode_array(r: Reader, what: str, depth: int) -> list:
    """Decode an array value after checking its element count against the bytes left."""
    if depth > MAX_ARRAY_DEPTH:
        r.fail(f"{what} is a nested array (array of arrays), which llama.cpp does not support")
    start = r.pos
    etype = r.u32(f"element type of {what}")
    spec = VALUE_TYPES.get(etype)
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


def _decode_string_array(r: Reader, n: int, what: str) -> list[str]:
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
def mapped(path: str):
    """A Reader over the whole file at ``path``, mapped read-only; InvalidGGUF if it cannot be."""
    f, size = _open_checked(path)
    with f:
        if size == 0:
            raise InvalidGGUF(path, "file is empty")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise InvalidGGUF(path, f"cannot map the file: {e}") from None
        try:
            yield Reader(path, mm, size)
        finally:
            mm.close()
