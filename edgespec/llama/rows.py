"""What one decode returns: its flagged rows, read lazily as logits or as the greedy token.

The backend can pick greedy tokens where the logits are (on the GPU) and copy back one token id
per row instead of the vocabulary's floats:
- ``ArgmaxPicks``, with a build that carries edgespec's output-argmax patch
  (native/llama_cpp_patches.py): one argmax over every flagged row of every sequence, so greedy
  verification reads ids only.
- ``BackendGreedy``, with a stock build: llama.cpp's greedy sampler on sequence 0, a view, an
  argmax and a copy per row (a plain 1.5B token on an H200: 1.85 ms against 1.91 reading logits;
  a verification: 5.80 ms against 5.65, so verifications read logits there).
Rows it did not pick come back as logits and their greedy token is their argmax, so every caller
reads the same thing either way. Sampling needs a row's largest logits only (its top-k, with the
few a repetition penalty may push out: edgespec.decode.sampling.backend_top_k); with the same patch
``OutputTopK`` takes them on the backend, and ``Rows.top`` returns k ids and logits a row.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp as lc  # isort: skip  (before numpy: see edgespec/llama/__init__.py)
import numpy as np

from edgespec.errors import BackendError


def _bind(set_name: str, get_name: str, set_args: list, get_args: list):
    """The build's (set, get) functions of one of edgespec's output patches, typed; None for a
    build without them."""
    try:
        lib = lc.llama_cpp._lib
        set_fn, get_fn = getattr(lib, set_name), getattr(lib, get_name)
    except AttributeError:
        return None
    set_fn.argtypes, set_fn.restype = [ctypes.c_void_p] + set_args, None
    get_fn.argtypes, get_fn.restype = [ctypes.c_void_p, ctypes.c_int32] + get_args, ctypes.c_int32
    return set_fn, get_fn


_ARGMAX = _bind("llama_set_output_argmax", "llama_get_argmax_ith", [ctypes.c_bool], [])
OUTPUT_ARGMAX = _ARGMAX is not None  # this build picks every row's argmax in one op
_TOPK = _bind("llama_set_output_topk", "llama_get_topk_ith", [ctypes.c_int32], [ctypes.c_void_p, ctypes.c_void_p])
OUTPUT_TOPK = _TOPK is not None  # this build can return every row's k largest logits in one op
_NULL = lc.LLAMA_TOKEN_NULL  # a row the backend picked no token for


class Rows:
    """The flagged rows of one decode, valid until the next decode on its context."""

    def __init__(self, ctx_ptr, n_vocab: int, flags: list[bool], current: Callable[[], bool],
                 picking: Callable[[object, int], int] | None,
                 topping: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None):
        """``picking``: how the backend's pick of a row is read (``ArgmaxPicks`` or
        ``BackendGreedy``'s ``read``, LLAMA_TOKEN_NULL where it picked none), None: no picks.
        ``topping``: how a row's largest logits are read (``OutputTopK.read``), None: not taken."""
        self._ctx, self._n_vocab, self._flags, self._current = ctx_ptr, n_vocab, flags, current
        self._picking, self._topping = picking, topping

    def _check(self, i: int) -> None:
        """Row ``i`` is readable: flagged, and no later decode overwrote it."""
        if not self._current():
            raise RuntimeError("logits read after a later decode overwrote them")
        if not (0 <= i < len(self._flags) and self._flags[i]):
            raise IndexError(f"row {i} was not flagged for logits")

    def _picked(self, i: int) -> int | None:
        """Row ``i``'s token where the backend picked it, else None (its logits came back)."""
        self._check(i)
        if self._picking is None:
            return None
        token = self._picking(self._ctx, i)
        return None if token == _NULL else int(token)

    def _logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, i), shape=(self._n_vocab,))

    def __call__(self, i: int) -> np.ndarray:
        """Row ``i``'s logits [n_vocab] (a copy)."""
        if self._picked(i) is not None or self._topping is not None:
            raise BackendError(f"row {i} was picked on the backend: its logits were not copied back")
        return self._logits(i).copy()

    def top(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Row ``i``'s largest logits as (token ids, logits), in no order, where the backend
        returned only those; None where the row's logits came back."""
        if self._topping is None:
            return None
        self._check(i)
        return self._topping(i)

    def greedy(self, i: int) -> int:
        """Row ``i``'s argmax: the backend's pick where it made one, else read from the logits
        (or from the largest of them)."""
        token = self._picked(i)
        if token is not None:
            return token
        top = self.top(i)
        if top is not None:
            return int(top[0][np.argmax(top[1])])
        return int(np.argmax(self._logits(i)))

    def row(self, i: int) -> "Row":
        return Row(self, i)


class Row:
    """One row of a decode: what plain decoding picks its next token from."""

    __slots__ = ("_rows", "_i")

    def __init__(self, rows: Rows, i: int):
        self._rows, self._i = rows, i

    def logits(self) -> np.ndarray:
        return self._rows(self._i)

    def greedy(self) -> int:
        return self._rows.greedy(self._i)

    def top(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self._rows.top(self._i)


class ArgmaxPicks:
    """Output argmax on one context, on or off: every flagged row comes back as its argmax."""

    every_row = True  # rows of every sequence, many rows a decode, one op and one copy

    def __init__(self, ctx_ptr):
        self._ctx = ctx_ptr
        self.attached = False

    def set(self, on: bool) -> bool:
        """Turns output argmax on or off (llama.cpp reserves its graphs again on a change)."""
        if on != self.attached:
            _ARGMAX[0](self._ctx, on)
            self.attached = on
        return on

    read = staticmethod(_ARGMAX[1] if OUTPUT_ARGMAX else None)  # ctx, row -> token id (an int)

    def close(self) -> None:
        self.attached = False


class OutputTopK:
    """Output top-k on one context: while ``k`` > 0 every flagged row comes back as its k largest
    logits and their token ids (edgespec's llama.cpp patch, one op over all rows)."""

    def __init__(self, ctx_ptr):
        self._ctx = ctx_ptr
        self.k = 0

    def set(self, k: int) -> int:
        """Takes each row's ``k`` largest logits from the next decode on (0: off; llama.cpp
        reserves its graphs again on a change); returns k."""
        if k != self.k:
            _TOPK[0](self._ctx, k)
            self.k = k
        return k

    def read(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids, logits = np.empty(self.k, np.int32), np.empty(self.k, np.float32)
        if _TOPK[1](self._ctx, i, ids.ctypes.data, logits.ctypes.data) != self.k:
            raise BackendError(f"no top-{self.k} logits for row {i} (see llama.cpp's log)")
        return ids.astype(np.int64), logits


class BackendGreedy:
    """A greedy sampler chain on sequence 0 of one context, attached or not.

    Attaching or detaching makes llama.cpp reserve its compute graph again, so the state only
    changes when a request needs the other one. With it attached, a decode whose flagged rows
    are all in sequence 0 copies back no logits, and its output buffer holds 4 floats' worth per
    vocabulary entry and row instead of 1 (sampled logits, probabilities, candidates).
    """

    every_row = False  # a view, an argmax and a copy per row: plain decoding's one row only

    def __init__(self, ctx_ptr):
        self._ctx = ctx_ptr
        self._chain = None
        self.attached = False

    read = staticmethod(lc.llama_get_sampled_token_ith)  # ctx, row -> token id (an int)

    def set(self, on: bool) -> bool:
        """Attaches (``on``) or detaches the sampler; whether it is attached afterwards. A chain
        is initialised for one context once (llama.cpp asserts), so each attach makes a new one."""
        if on == self.attached:
            return on
        if on:
            self._chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
            lc.llama_sampler_chain_add(self._chain, lc.llama_sampler_init_greedy())
            self.attached = bool(lc.llama_set_sampler(self._ctx, 0, self._chain))
            if not self.attached:
                self._free_chain()
        else:
            self.close()
        return self.attached

    def close(self) -> None:
        """Detaches and frees the chain (before the context itself is freed)."""
        if self.attached:
            lc.llama_set_sampler(self._ctx, 0, None)
            self.attached = False
        self._free_chain()

    def _free_chain(self) -> None:
        if self._chain is not None:
            lc.llama_sampler_free(self._chain)
            self._chain = None
