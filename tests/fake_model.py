"""An exact fake of llama.cpp for plumbing tests: FakeModel + FakeContext, no weights.

``FakeContext`` copies ``edgespec.llama.backend.LlamaContext``'s interface and llama.cpp's KV
semantics (unified cache, llama-batch.cpp's batch checks, llama-kv-cache.cpp's mask):

* a cell holds a token, a position and a set of sequence ids; a batch row is written to a free
  cell with all of its sequence ids, and attends to the occupied cells that hold the row's FIRST
  sequence id (llama.cpp reads ``seq_id[i][0]`` for the mask) at positions <= its own, the
  batch's own cells included (ubatch by ubatch, as llama.cpp splits ``n_batch`` into
  ``n_ubatch``);
* a batch is refused like ``llama_decode`` refuses it: a sequence's positions in the batch must
  start right after its last cached position, leave no gap, never decrease in batch order, and
  sequences coupled by one row must hold the same positions; the cache must have room.

A transformer row's output depends on the keys and values of the cells it attends to, and a
cell's keys and values depend on what *its* row attended to when it was written. The fake
keeps exactly that: every cell stores a hash of the token sequence it saw, and a row must see
exactly one cell per position 0..p whose stored hashes equal the row's own prefix — else
``KVLayoutError``. Its logits are then a deterministic function of that token sequence
(``FakeModel.logits``), so a batch gives the same logits as one-token decoding, bit for bit, and
speculative greedy decoding must equal plain greedy decoding exactly.

``FakeModel.logits`` mixes a hash-seeded random row (``sharpness`` scales it: well separated
argmaxes) with copying: with probability ``copy_prob`` (decided by the hash) the token that
followed the previous occurrence of the current token wins by ``copy_margin``, so text repeats
the way suffix drafts need. ``perturb`` adds a second hash-seeded row: a drafter model that
agrees with its target most of the time.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgespec.errors import BackendError, InvalidRequest
from edgespec.llama.backend import TOP_K_MAX, rows_allowed
from edgespec.llama.rows import Row

_K = np.uint64(0x9E3779B97F4A7C15)  # odd: invertible mod 2**64
_K_INV = np.uint64(pow(int(_K), -1, 1 << 64))
_MASK64 = (1 << 64) - 1
BOS, EOS = 0, 1


class KVLayoutError(AssertionError):
    """A row attended to something other than exactly its own prefix: a KV-layout bug."""


_BITS = [np.uint64(1 << s) for s in range(64)]  # the cell bit of each sequence id


def _mix(x: int) -> int:
    """splitmix64's finalizer: every input bit reaches every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class _Powers:
    """K**i and K**-i mod 2**64 for i < n, grown on demand (uint64 arithmetic wraps)."""

    def __init__(self) -> None:
        self.fwd = np.ones(1, np.uint64)
        self.inv = np.ones(1, np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.fwd) < n:
            m = max(n, 2 * len(self.fwd))
            fwd, inv = np.ones(m, np.uint64), np.ones(m, np.uint64)
            with np.errstate(over="ignore"):
                for i in range(1, m):
                    fwd[i] = fwd[i - 1] * _K
                    inv[i] = inv[i - 1] * _K_INV
            self.fwd, self.inv = fwd, inv
        return self.fwd[:n], self.inv[:n]


_POWERS = _Powers()


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """[n] uint64: H[k] = sum_{i<=k} (t_i + 1) K**(k-i) mod 2**64, the hash of tokens[:k+1].
    (numpy's integer array arithmetic wraps without a warning.)"""
    fwd, inv = _POWERS.get(len(tokens))
    return np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * inv, dtype=np.uint64) * fwd


class FakeModel:
    """Vocabulary and logits of a fake language model over ``n_vocab`` tokens.

    Token 0 is BOS, token 1 EOS (the only end-of-generation token), every other token t reads
    " w<t>". ``logits(tokens)`` is the model: the logits after ``tokens`` (positions 0..p).
    """

    def __init__(self, n_vocab: int = 96, seed: int = 0, sharpness: float = 2.0,
                 copy_prob: float = 0.6, copy_margin: float = 3.0, eos_bias: float = -2.0,
                 perturb: float = 0.0, perturb_seed: int = 1, buckets: int = 1 << 12):
        if n_vocab < 3:
            raise ValueError("n_vocab must be >= 3")
        self.n_vocab = n_vocab
        self.path = f"fake-{n_vocab}-{seed}-{perturb}"
        self.sharpness, self.copy_prob, self.copy_margin = sharpness, copy_prob, copy_margin
        self.perturb = perturb
        self._salt = _mix(seed + 0x5EED)
        self._perturb_salt = _mix(perturb_seed + 0xF00D)
        self._table = np.random.default_rng(seed).standard_normal((buckets, n_vocab)).astype(np.float32)
        self._table *= sharpness
        self._table[:, EOS] += eos_bias
        self._table[:, BOS] = -1e4  # never generated
        self._perturb = (np.random.default_rng(perturb_seed + 7919).standard_normal((buckets, n_vocab))
                         .astype(np.float32) * perturb) if perturb else None
        self.n_ctx_train = 1 << 20
        self.chat_template = None

    # -- the model --------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """[n_vocab] float32 logits after ``tokens`` (the whole context, position 0 first)."""
        toks = np.asarray(tokens, np.int64)
        return self._logits(toks, int(prefix_hashes(toks)[-1]))

    def _logits(self, toks: np.ndarray, raw_hash: int) -> np.ndarray:
        h = _mix(raw_hash ^ self._salt ^ len(toks))
        row = self._table[h % len(self._table)].copy()
        prev = (toks[:-1] == toks[-1]).nonzero()[0]
        if len(prev) and (h >> 40) % 1024 < self.copy_prob * 1024:
            row[toks[prev[-1] + 1]] = row.max() + self.copy_margin
        if self._perturb is not None:
            row += self._perturb[_mix(raw_hash ^ self._perturb_salt) % len(self._perturb)]
        return row

    def greedy(self, prompt: Sequence[int], n: int, stop_at_eos: bool = False) -> list[int]:
        """The reference: plain greedy decoding straight from ``logits``, no cache at all."""
        seq, out = list(prompt), []
        for _ in range(n):
            t = int(np.argmax(self.logits(seq)))
            if stop_at_eos and t == EOS:
                break
            out.append(t)
            seq.append(t)
        return out

    # -- vocabulary (LlamaModel's interface) -------------------------------------------------
    bos, eos, add_bos = BOS, EOS, True

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def token_piece(self, token: int) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise InvalidRequest(f"token id {token} out of range [0, {self.n_vocab})")
        return b"" if token in (BOS, EOS) else b" w%d" % token

    def token_text(self, token: int) -> str:
        return {BOS: "<s>", EOS: "</s>"}.get(token) or self.token_piece(token).decode()

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """" w5 w17" -> [BOS, 5, 17]: the inverse of token_piece."""
        ids = [int(w[1:]) for w in text.split()]
        return ([BOS] if add_special else []) + ids

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + (self._perturb.nbytes if self._perturb is not None else 0)


class FakeRows:
    """The rows of one fake decode, read as edgespec.llama.rows.Rows reads them: a row picked
    on the backend gives its argmax and has no logits to read; with output top-k on (``top_k``)
    every row gives its k largest logits, in no order, and no logits either."""

    def __init__(self, read, picked: set[int], top_k: int = 0):
        self._read, self._picked, self._top_k = read, picked, top_k

    def __call__(self, i: int) -> np.ndarray:
        if i in self._picked or self._top_k:
            raise BackendError(f"row {i} was picked on the backend: its logits were not copied back")
        return self._read(i)

    def top(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        if not self._top_k:
            return None
        row = self._read(i)
        ids = np.argpartition(-row, self._top_k - 1)[:self._top_k]
        ids = ids[np.random.default_rng(i).permutation(len(ids))]  # the backend's order is none
        return ids.astype(np.int64), row[ids]

    def greedy(self, i: int) -> int:
        return int(np.argmax(self._read(i)))  # the same argmax, wherever it is taken

    def row(self, i: int) -> Row:
        return Row(self, i)


class FakeContext:
    """A KV cache with llama.cpp's semantics over a FakeModel (LlamaContext's interface).

    Tests may also read ``cells(seq)`` and inject failures: ``fail_decode_at`` /
    ``fail_read_at`` make the k-th later decode / logits read raise BackendError (a decode that
    fails changes nothing, as when llama_decode finds no room).
    """

    def __init__(self, model: FakeModel, n_ctx: int = 512, n_batch: int = 512, n_seq_max: int = 1,
                 n_ubatch: int | None = None, n_outputs_max: int | None = None, greedy_on_backend: bool = False,
                 output_argmax: bool = False, output_topk: bool = False):
        if not 1 <= n_seq_max <= 64:
            raise InvalidRequest("n_seq_max must be in [1, 64]")
        self.model = model
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.n_ubatch = min(n_ubatch or n_batch, n_batch)
        self.n_outputs_max = rows_allowed(n_outputs_max, n_batch, n_seq_max)
        self._tok = np.zeros(n_ctx, np.int64)
        self._pos = np.zeros(n_ctx, np.int64)
        self._hash = np.zeros(n_ctx, np.uint64)  # hash of the tokens the cell's row attended to
        self._seqs = np.zeros(n_ctx, np.uint64)  # bit s: the cell belongs to sequence s; 0: free
        self._generation = 0
        self.decodes = 0  # decode calls that ran
        self.rows_evaluated = 0  # batch rows written to the cache
        self._fail_decode_in: int | None = None
        self._fail_read_in: int | None = None
        self._closed = False
        self.greedy_on_backend = greedy_on_backend
        self.output_argmax = output_argmax  # a build with output argmax (every row), else seq 0's rows
        self.output_topk = output_topk  # a build with output top-k
        self._picking = False
        self._top_k = 0

    def pick_on_backend(self, on: bool, every_row: bool = False) -> bool:
        """As LlamaContext.pick_on_backend: flagged rows come back as their argmax only."""
        self._picking = on and self.greedy_on_backend and (self.output_argmax or not every_row)
        return self._picking

    def top_on_backend(self, k: int) -> bool:
        """As LlamaContext.top_on_backend: flagged rows come back as their k largest logits."""
        on = 0 < k <= TOP_K_MAX and self.output_topk and self.greedy_on_backend and not self._picking
        if self.output_topk:
            self._top_k = min(k, self.model.n_vocab) if on else 0
        return on

    @property
    def picking(self) -> bool:
        return self._picking

    # -- fault injection ---------------------------------------------------------------------
    def fail_decode_at(self, k: int | None) -> None:
        """The k-th decode from now (1 = the next one) raises BackendError; None: never."""
        self._fail_decode_in = k

    def fail_read_at(self, k: int | None) -> None:
        """The k-th logits row read from now raises BackendError; None: never."""
        self._fail_read_in = k

    # -- decoding ----------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]], logits: Sequence[bool]) -> np.ndarray:
        """The flagged rows' logits, [flagged, n_vocab] float32 in batch order."""
        self._top_k = 0
        rows = self.decode_rows(tokens, positions, seq_ids, logits)
        flagged = [i for i in range(len(tokens)) if logits[i]]
        out = np.empty((len(flagged), self.model.n_vocab), np.float32)
        for k, i in enumerate(flagged):
            out[k] = rows(i)
        return out

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int],
                    seq_ids: Sequence[Sequence[int]], logits: Sequence[bool], trims_after: bool = False):
        """Runs a batch; returns ``row(i)``, valid until the next decode (as LlamaContext, which
        pads; this fake never does, so ``trims_after`` changes nothing)."""
        self._check_open()
        tokens, positions = [int(t) for t in tokens], [int(p) for p in positions]
        seq_ids, flags = [[int(s) for s in ids] for ids in seq_ids], [bool(f) for f in logits]
        self._check_batch(tokens, positions, seq_ids, flags)
        if self._fail_decode_in is not None:
            self._fail_decode_in -= 1
            if self._fail_decode_in == 0:
                self._fail_decode_in = None
                raise BackendError("llama_decode failed (code 1): no room in the KV cache (injected)")
        self._check_llama_batch(positions, seq_ids)
        free = np.flatnonzero(self._seqs == 0)
        n = len(tokens)
        if len(free) < n:
            raise BackendError("llama_decode failed (code 1): no room in the KV cache")
        saved = (self._tok.copy(), self._pos.copy(), self._hash.copy(), self._seqs.copy())
        try:
            out = self._run(tokens, positions, seq_ids, flags, free[:n])
        except KVLayoutError:
            self._tok, self._pos, self._hash, self._seqs = saved  # a failed decode changes nothing
            raise
        self.decodes += 1
        self.rows_evaluated += n
        self._generation += 1
        generation = self._generation

        def row(i: int) -> np.ndarray:
            if generation != self._generation:
                raise RuntimeError("logits read after a later decode overwrote them")
            if not (0 <= i < n and flags[i]):
                raise IndexError(f"row {i} was not flagged for logits")
            if self._fail_read_in is not None:
                self._fail_read_in -= 1
                if self._fail_read_in == 0:
                    self._fail_read_in = None
                    raise BackendError("reading logits failed (injected)")
            return out[i].copy()

        # output argmax picks every flagged row; llama.cpp's backend sampler those of sequence 0
        picked = {i for i in range(n) if flags[i] and self._picking and (self.output_argmax or seq_ids[i][0] == 0)}
        return FakeRows(row, picked, 0 if self._picking else self._top_k)

    def _run(self, tokens, positions, seq_ids, flags, cells) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        for start in range(0, len(tokens), self.n_ubatch):
            ub = range(start, min(start + self.n_ubatch, len(tokens)))
            for i in ub:  # llama.cpp stores the whole ubatch before attending
                c = cells[i]
                self._tok[c], self._pos[c] = tokens[i], positions[i]
                self._seqs[c] = np.uint64(sum(1 << s for s in set(seq_ids[i])))
            for i in sorted(ub, key=lambda i: positions[i]):  # a row needs its prefix's hashes
                toks, raw = self._attend(cells[i], positions[i], seq_ids[i])
                self._hash[cells[i]] = np.uint64(raw)
                if flags[i]:
                    out[i] = self.model._logits(toks, raw)
        return out

    def _attend(self, cell: int, pos: int, ids: list[int]) -> tuple[np.ndarray, int]:
        """The tokens row ``cell`` attends to, checked to be exactly its own prefix."""
        upto = self._pos <= pos
        seen = ((self._seqs & _BITS[ids[0]]) != 0) & upto
        if len(ids) > 1:
            row_mask = np.uint64(sum(1 << s for s in ids))
            if not np.array_equal(seen, ((self._seqs & row_mask) != 0) & upto):
                raise KVLayoutError(f"row at position {pos} of sequences {ids}: its sequences see "
                                    "different cells (the layout depends on which one llama.cpp reads)")
        idx = seen.nonzero()[0]
        # Exactly one cell per position 0..pos: pos + 1 cells whose positions fill every slot
        # (a cheaper test than sorting and comparing; the message sorts).
        by_pos = np.full(pos + 1, -1, np.int64)
        by_pos[self._pos[idx]] = idx
        if len(idx) != pos + 1 or (by_pos < 0).any():
            idx = idx[np.argsort(self._pos[idx], kind="stable")]
            raise KVLayoutError(f"row at position {pos} of sequence {ids[0]} attends to positions "
                                f"{self._pos[idx].tolist()}, not exactly one cell per position 0..{pos}")
        toks = self._tok[by_pos]
        hashes = prefix_hashes(toks)
        # The cells before this row's own (at position pos, its hash not yet stored).
        wrong = self._hash[by_pos[:-1]] != hashes[:-1]
        if wrong.any():
            raise KVLayoutError(f"row at position {pos} of sequence {ids[0]} attends to the cell at "
                                f"position {int(wrong.nonzero()[0][0])}, which was computed after other tokens")
        return toks, int(hashes[-1])

    def _check_batch(self, tokens, positions, seq_ids, flags) -> None:
        """edgespec.llama.batch.Batch.fill's rules (InvalidRequest)."""
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("empty batch")
        if not (len(positions) == len(seq_ids) == len(flags) == n):
            raise InvalidRequest("tokens, positions, seq_ids and logits must have the same length")
        if n > self.n_batch:
            raise InvalidRequest(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        rows = sum(map(bool, flags))
        if rows > self.n_outputs_max:
            raise InvalidRequest(f"batch asks for {rows} logits rows; the context allows {self.n_outputs_max}")
        for i in range(n):
            if not 0 <= tokens[i] < self.model.n_vocab:
                raise InvalidRequest(f"token id {tokens[i]} out of range [0, {self.model.n_vocab})")
            if not 0 <= positions[i] < self.n_ctx:
                raise InvalidRequest(f"position {positions[i]} outside the context of {self.n_ctx}")
            if not seq_ids[i] or any(not 0 <= s < self.n_seq_max for s in seq_ids[i]):
                raise InvalidRequest(f"row {i}: sequence ids must be in [0, {self.n_seq_max})")

    def _check_llama_batch(self, positions, seq_ids) -> None:
        """llama_batch_allocr::init's refusals (llama_decode returns -1: BackendError)."""
        batch_pos: dict[int, set[int]] = {}
        last: dict[int, int] = {}
        ranges: dict[int, tuple[int, int]] = {}  # the cache's, which the check does not change

        def pos_range(s: int) -> tuple[int, int]:
            if s not in ranges:
                ranges[s] = self._pos_range(s)
            return ranges[s]

        for p, ids in zip(positions, seq_ids):
            for s in ids:
                batch_pos.setdefault(s, set()).add(p)
                if p < last.get(s, -1):
                    raise BackendError(f"llama_decode failed: sequence {s} positions are decreasing")
                last[s] = p
            for s in ids[1:]:
                if pos_range(s) != pos_range(ids[0]):
                    raise BackendError(f"llama_decode failed: sequence {s} is coupled to {ids[0]} "
                                       "in the input batch, but they have diverged")
        for s, ps in batch_pos.items():
            top = self.seq_pos_max(s)
            if top >= 0 and min(ps) != top + 1:
                raise BackendError(f"llama_decode failed: sequence {s} holds positions up to {top}, "
                                   f"the batch starts at {min(ps)}")
            if max(ps) - min(ps) + 1 > len(ps):
                raise BackendError(f"llama_decode failed: sequence {s} positions are not continuous")

    # -- KV cache edits (llama_memory_* semantics) --------------------------------------------
    def _in(self, seq: int) -> np.ndarray:
        if 0 <= seq < 64:
            return (self._seqs & _BITS[seq]) != 0
        return ((self._seqs >> np.uint64(seq)) & np.uint64(1)).astype(bool)

    def _range(self, p0: int, p1: int) -> np.ndarray:
        p0 = 0 if p0 < 0 else p0
        return (self._pos >= p0) & ((self._pos < p1) if p1 >= 0 else True)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise AssertionError(f"sequence id {seq} outside [0, {self.n_seq_max}): llama.cpp aborts")

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        self._check_open()
        sel = self._range(p0, p1) & (self._seqs != 0)
        if seq < 0:
            self._seqs[sel] = 0
            return
        self._check_seq(seq)
        self._seqs[sel] &= ~np.uint64(1 << seq)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        self._check_open()
        self._check_seq(src)
        self._check_seq(dst)
        if src == dst:
            return
        sel = self._in(src) & self._range(p0, p1)
        self._seqs[sel] |= np.uint64(1 << dst)

    def seq_keep(self, seq: int) -> None:
        self._check_open()
        self._check_seq(seq)
        self._seqs &= np.uint64(1 << seq)

    def seq_pos_max(self, seq: int) -> int:
        sel = self._in(seq)
        return int(self._pos[sel].max()) if sel.any() else -1

    def _pos_range(self, seq: int) -> tuple[int, int]:
        sel = self._in(seq)
        return (int(self._pos[sel].min()), int(self._pos[sel].max())) if sel.any() else (-1, -1)

    def clear(self) -> None:
        self._check_open()
        self._seqs[:] = 0

    # -- inspection (tests) ------------------------------------------------------------------
    def cells(self, seq: int) -> list[tuple[int, int]]:
        """(position, token) of every cell of ``seq``, by position."""
        sel = np.flatnonzero(self._in(seq))
        order = np.argsort(self._pos[sel], kind="stable")
        return [(int(self._pos[c]), int(self._tok[c])) for c in sel[order]]

    @property
    def used_cells(self) -> int:
        return int((self._seqs != 0).sum())

    # -- memory ------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        return {"weights": self.model.nbytes, "kv_cache": self._tok.nbytes * 4,
                "logits_buffer": 4 * self.model.n_vocab * self.n_outputs_max, "state": 0}

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the context is closed")
