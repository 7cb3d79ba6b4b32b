"""Token-array helpers with an optional C implementation (native/tokens.c).

``common_prefix`` is the pure-Python twin; ``fast_common_prefix`` is the C version when the
extension was built at install, else the twin. Tests run both on the same cases.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (pure Python)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _load_native():
    try:
        from edgespec import _native_tokens  # type: ignore[attr-defined]
    except ImportError:
        log.debug("native tokens extension not built; using the pure-Python twin")
        return None
    return _native_tokens


_native = _load_native()
HAVE_NATIVE = _native is not None


def fast_common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """``common_prefix`` through the C extension when available."""
    if _native is None:
        return common_prefix(a, b)
    return _native.common_prefix(np.ascontiguousarray(a, dtype=np.int32),
                                 np.ascontiguousarray(b, dtype=np.int32))
