"""A llama.cpp batch over numpy arrays: filled and checked a column at a time.

``llama_batch_init`` allocates one seq-id array per row, so a batch filled through ctypes costs a
handful of attribute writes per token (a 30-token verification spent more filling and checking
its batch in Python than the greedy acceptance that follows). Here every field is a view of one
numpy array, the seq ids one matrix of ``n_seq_max`` columns, and llama.cpp reads them in place.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as lc  # isort: skip  (before numpy: see edgespec/llama/__init__.py)
import numpy as np

from edgespec.errors import InvalidRequest


def _ptr(array: np.ndarray, ctype):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


class Batch:
    """Up to ``n_batch`` tokens of one decode, each in up to ``n_seq_max`` sequences."""

    def __init__(self, n_batch: int, n_seq_max: int):
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self.token = np.zeros(n_batch, np.int32)
        self.pos = np.zeros(n_batch, np.int32)
        self.n_seq_id = np.zeros(n_batch, np.int32)
        self.seq_id = np.zeros((n_batch, n_seq_max), np.int32)
        self.logits = np.zeros(n_batch, np.int8)
        row_bytes = self.seq_id.strides[0]
        self._rows = (ctypes.POINTER(ctypes.c_int32) * n_batch)(
            *(ctypes.cast(self.seq_id.ctypes.data + i * row_bytes, ctypes.POINTER(ctypes.c_int32))
              for i in range(n_batch)))
        self.struct = lc.llama_batch(n_tokens=0, token=_ptr(self.token, ctypes.c_int32), embd=None,
                                     pos=_ptr(self.pos, ctypes.c_int32),
                                     n_seq_id=_ptr(self.n_seq_id, ctypes.c_int32),
                                     seq_id=ctypes.cast(self._rows, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
                                     logits=_ptr(self.logits, ctypes.c_int8))
        # what fill saw, for pad: the one sequence of every row (None: several) and the position
        # after the last row, so pad reads no numpy reductions (a third of a verification's batch)
        self._n, self._one_seq, self._end = 0, None, 0

    def fill(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
             logits: Sequence[bool], n_vocab: int, n_ctx: int) -> int:
        """Puts a batch in place and checks it as llama.cpp would refuse it, before it reads it;
        returns the number of flagged rows. Raises InvalidRequest naming the first bad row."""
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("empty batch")
        if not (len(positions) == len(seq_ids) == len(logits) == n):
            raise InvalidRequest("tokens, positions, seq_ids and logits must have the same length")
        if n > self.n_batch:
            raise InvalidRequest(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        # min/max over the lists first: the range checks also keep every value inside int32
        _in_range(tokens, n_vocab, lambda i: f"token id {tokens[i]} out of range [0, {n_vocab})")
        end = _in_range(positions, n_ctx, lambda i: f"position {positions[i]} outside the context of {n_ctx}") + 1
        lens = [len(ids) for ids in seq_ids]
        self._n, self._one_seq, self._end = n, self._seq_ids(seq_ids, lens, n), int(end)
        if n == 1:  # a plain step: element writes cost a tenth of a slice's
            self.token[0], self.pos[0], self.n_seq_id[0] = tokens[0], positions[0], lens[0]
            self.logits[0] = 1 if logits[0] else 0
            return int(self.logits[0])
        self.token[:n] = tokens
        self.pos[:n] = positions
        self.n_seq_id[:n] = 1 if self._one_seq is not None else lens
        self.logits[:n] = logits
        return int(np.count_nonzero(self.logits[:n]))

    def pad(self, n: int, to: int, n_ctx: int) -> tuple[int, int] | None:
        """Extends the batch of ``n`` rows that ``fill`` just put in place to ``to`` rows when
        every row is in one and the same sequence: each added row repeats the last one's token and
        flag at the next position. Returns (that sequence, the first added position), or None where
        the batch stays as it is (several sequences, or positions past the context)."""
        if to <= n or n != self._n or self._one_seq is None or self._end + to - n > n_ctx:
            return None
        start = self._end
        self.token[n:to], self.logits[n:to], self.n_seq_id[n:to] = self.token[n - 1], self.logits[n - 1], 1
        self.seq_id[n:to, 0] = self._one_seq
        self.pos[n:to] = np.arange(start, start + to - n)
        return self._one_seq, start

    def _seq_ids(self, seq_ids: Sequence[Sequence[int]], lens: list[int], n: int) -> int | None:
        """Puts the rows' sequence ids in place; returns the one sequence every row is in, None
        where rows are in several."""
        def bad(i: int) -> str:
            return f"row {i}: sequence ids must be in [0, {self.n_seq_max})"
        if min(lens) == max(lens) == 1:  # every row in one sequence: one column
            first = [ids[0] for ids in seq_ids]
            _in_range(first, self.n_seq_max, bad)
            if n == 1:
                self.seq_id[0, 0] = first[0]
            else:
                self.seq_id[:n, 0] = first
            return first[0] if first.count(first[0]) == n else None
        for i, ids in enumerate(seq_ids):
            if not 1 <= len(ids) <= self.n_seq_max or min(ids) < 0 or max(ids) >= self.n_seq_max:
                raise InvalidRequest(bad(i))
            self.seq_id[i, :len(ids)] = ids
        return None


def _in_range(values: Sequence[int], end: int, message) -> int:
    """The largest value; raises InvalidRequest(message(i)) for the first value outside [0, end)."""
    top = max(values)
    if min(values) < 0 or top >= end:
        raise InvalidRequest(message(next(i for i, v in enumerate(values) if not 0 <= v < end)))
    return top
