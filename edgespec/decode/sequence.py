"""The one owner of a context's KV cache: which tokens sequence 0 holds, and every edit to it.

``KVSequence`` keeps the token mirror and the cache together. Plain decoding appends one token
at a time; prefill keeps the longest common prefix with what the cache holds and evaluates the
rest; a speculative step decodes pending + a draft tree in one batch (``verify``), then either
``commit``s the accepted path or, if anything raises in between, ``rollback`` restores the cache
to the mirror, so the next request starts from a cache equal to a fresh prefill.

Tree layout of a verification (see edgespec.decode.verify): the context sits at positions
0..L-1 of sequence 0, pending at L, draft node i at L + depth(i); every root-to-leaf path gets
its own sequence id 1..k, into which the context is shared first.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar


from edgespec.decode.tokens import fast_common_prefix
from edgespec.decode.tree import DraftTree
from edgespec.decode.verify import is_chain, path_layout
from edgespec.llama.rows import Row, Rows

SEQ_MAIN = 0
T = TypeVar("T")


class KVSequence:
    """Sequence 0 of one context: ``tokens`` are the KV entries at positions 0..len-1."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.tokens: list[int] = []
        self._paths = 0  # path sequences holding uncommitted cells
        self._node_paths: list[list[int]] = []  # the verified tree's path_layout, for its commit

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_paths(self) -> int:
        """Root-to-leaf paths a verified tree may have (one sequence id each)."""
        return self.ctx.n_seq_max - 1

    # -- plain edits ----------------------------------------------------------------------------
    def sync(self, tokens: Sequence[int]) -> tuple[Row, int]:
        """Brings the cache to exactly ``tokens`` (non-empty); returns the row after them.

        Returns:
            (the last token's row, tokens kept from the cache). The last token is always
            evaluated again: its row is not kept.
        """
        keep = min(fast_common_prefix(self.tokens, tokens), len(tokens) - 1)
        self.trim(keep)
        row = None
        n_batch = self.ctx.n_batch
        for start in range(keep, len(tokens), n_batch):
            chunk = list(tokens[start:start + n_batch])
            last = start + len(chunk) == len(tokens)
            rows = self.ctx.decode_rows(chunk, range(start, start + len(chunk)), [[SEQ_MAIN]] * len(chunk),
                                        [last and i == len(chunk) - 1 for i in range(len(chunk))])
            self.tokens.extend(chunk)
            if last:
                row = rows.row(len(chunk) - 1)
        return row, keep

    def append(self, token: int) -> Row:
        """Appends one token and returns the row after it."""
        rows = self.ctx.decode_rows([token], [len(self.tokens)], [[SEQ_MAIN]], [True])
        self.tokens.append(int(token))
        return rows.row(0)

    def trim(self, n: int) -> None:
        """Keeps the first ``n`` tokens."""
        self.ctx.seq_rm(SEQ_MAIN, n, -1)
        del self.tokens[n:]

    def clear(self) -> None:
        self.ctx.clear()
        self.tokens = []
        self._paths = 0

    def rollback(self) -> None:
        """Drops every cell that is not in the mirror: path sequences and sequence 0's tail."""
        for seq in range(1, self._paths + 1):
            self.ctx.seq_rm(seq, -1, -1)
        self._paths = 0
        self.ctx.seq_rm(SEQ_MAIN, len(self.tokens), -1)

    # -- speculative steps ----------------------------------------------------------------------
    @contextlib.contextmanager
    def verifying(self, pending: int, draft: DraftTree,
                  alongside: Callable[[], None] | None = None) -> Iterator["Verification"]:
        """Decodes pending + ``draft`` in ONE batch; the block must ``commit`` a path.

        ``alongside`` runs in this thread while the batch decodes in another (llama.cpp releases
        the GIL), e.g. a drafter on another processor drafting ahead. Whatever happens in the
        block, the cache afterwards matches ``tokens``: committed, or rolled back when the block
        raised (or returned without committing).
        """
        verification = Verification(self, pending, draft)
        try:
            decode = functools.partial(self._decode_tree, pending, draft)
            verification.rows = decode() if alongside is None else run_beside(decode, alongside)
            yield verification
        finally:
            if not verification.committed:
                self.rollback()

    def _decode_tree(self, pending: int, draft: DraftTree) -> Rows:
        n, base = len(draft), len(self.tokens)
        tokens = [pending] + draft.tokens.tolist()
        if n == 0 or is_chain(draft):
            positions = list(range(base, base + n + 1))
            seqs = [[SEQ_MAIN]] * (n + 1)
        else:
            leaves, node_paths = path_layout(draft)
            if len(leaves) > self.max_paths:
                raise ValueError(f"draft has {len(leaves)} paths; the context allows {self.max_paths}")
            self._paths, self._node_paths = len(leaves), node_paths
            for seq in range(1, len(leaves) + 1):
                self.ctx.seq_cp(SEQ_MAIN, seq, 0, base)  # the context is visible from every path
            seqs = [list(range(1, len(leaves) + 1))] + node_paths
            positions = [base] + (base + draft.depth()).tolist()
        # trims_after: the commit or rollback that ends every verification removes a pad's cells
        return self.ctx.decode_rows(tokens, positions, seqs, [True] * (n + 1), trims_after=True)

    def _commit(self, pending: int, draft: DraftTree, path: Sequence[int]) -> None:
        base = len(self.tokens)
        keep_until = base + 1 + len(path)
        if self._paths:
            seq = self._node_paths[path[-1]][0] if path else 1
            self.ctx.seq_cp(seq, SEQ_MAIN, base, keep_until)
        drafted = draft.tokens.tolist()
        self.tokens.extend([pending] + [drafted[i] for i in path])
        self.rollback()  # frees the path sequences and anything past the accepted path


@functools.cache
def _worker() -> ThreadPoolExecutor:
    """The one thread that runs work beside the caller's (a verification beside drafting, a
    request's start beside its prefill), started on first use."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-beside")


def start_beside(work: Callable[[], T]) -> Future:
    """Starts ``work()`` in the worker thread; the caller waits for the future's result before
    it touches anything ``work`` does."""
    return _worker().submit(work)


def run_beside(work: Callable[[], T], alongside: Callable[[], None]) -> T:
    """``work()`` in a worker thread while ``alongside()`` runs in this one; ``work``'s result.

    Returns (or raises) only once both are done, so that no caller touches a context that is
    still decoding; ``work``'s exception wins over ``alongside``'s.
    """
    future = start_beside(work)
    try:
        alongside()
    finally:
        result = future.result()  # waits; raises work's exception
    return result


class Verification:
    """One verified draft: ``rows`` gives the target's rows (edgespec.llama.rows), ``commit``
    keeps a path."""

    def __init__(self, seq: KVSequence, pending: int, draft: DraftTree):
        self._seq, self.pending, self.draft = seq, pending, draft
        self.rows: Rows | None = None
        self.committed = False

    def commit(self, path: Sequence[int]) -> None:
        """Keeps pending + the accepted ``path`` (node indices from the root) in sequence 0."""
        self._seq._commit(self.pending, self.draft, path)
        self.committed = True
