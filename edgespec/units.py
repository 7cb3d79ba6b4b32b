"""Byte sizes as people write them: "2GiB", "2048M", "1.5 GB", "1073741824".

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024 and decimal ones (kB, MB, GB, TB)
powers of 1000. A bare letter (K, M, G, T, any case) is binary, as in the memory options of
most tools (``docker --memory 2g``). A number without a suffix, or with "B", is bytes. Sizes must be positive and finite; fractions of a byte round down.
"""
from __future__ import annotations

import math
import re

from edgespec.errors import InvalidRequest

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parses a byte size; raises InvalidRequest (with the accepted forms) for anything else.

    Examples: "2GiB" -> 2147483648, "2048M" -> 2147483648, "1.5GB" -> 1500000000, "4096" -> 4096.
    """
    if isinstance(text, bool):
        raise InvalidRequest(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise InvalidRequest(f"a byte size must be positive, got {text}")
        return text
    m = _SIZE.match(str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise InvalidRequest(f"not a byte size: {text!r} (use e.g. 2GiB, 2048MiB, 1.5GB or a number of bytes)")
    value, unit = float(m.group(1)), m.group(2).lower()
    n = value * _UNITS[unit]
    if not math.isfinite(n) or int(n) <= 0:
        raise InvalidRequest(f"a byte size must be positive, got {text!r}")
    return int(n)


def format_bytes(n: float) -> str:
    """A short binary rendering: 1536 -> '1.50 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover
