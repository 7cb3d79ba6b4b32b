"""KV cache bookkeeping for decoding the nodes of draft trees in a drafter's context.

Sequence 0 holds a base context. A node is ``(start, tokens)``: the tokens that follow the first
``start`` tokens of sequence 0 (a tree drafted after the whole context has ``start =
len(context)``; the replay recorder keeps trees rooted inside a longer sequence 0). Each
sequence holds one path; a child claims its parent's sequence when the parent is that
sequence's deepest node, else gets a new sequence that shares the parent's cells (``seq_cp``
over the positions before the child: no copy in a unified cache). A node whose parent's cells
are gone is decoded after re-decoding its parent's path. A search forgets nodes it will not
extend (each with its subtree): their sequences are cut above them, or freed when nothing on
them is left, so sequences in use never outnumber the nodes still held.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Node = tuple[int, tuple[int, ...]]  # (start, tokens)


class PathKV:
    """Which sequence holds which node's path; decodes batches of nodes."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._seq: dict[Node, int] = {}  # node -> a sequence whose cells hold its path
        self._tail: dict[int, Node] = {}  # sequence -> its deepest node
        self._free = list(range(ctx.n_seq_max - 1, 0, -1))

    def decode(self, nodes: Sequence[Node]) -> np.ndarray:
        """Logits after each node's path, one batch (rows in ``nodes``' order)."""
        need = sum(1 + (len(n[1]) > 1 and (n[0], n[1][:-1]) not in self._seq) for n in nodes)
        if len(self._free) < need:  # a node takes at most one new sequence, its re-decoded path one more
            self.release()
        return self._decode(nodes)

    def _decode(self, nodes: Sequence[Node]) -> np.ndarray:
        seqs = [self._place(n) for n in nodes]
        return self.ctx.decode([n[1][-1] for n in nodes], [_pos(n) for n in nodes],
                               [[s] for s in seqs], [True] * len(nodes))

    def release(self, dead: Callable[[Node], bool] | None = None) -> None:
        """Frees the sequences of the nodes ``dead`` names (all when None)."""
        gone = {s for n, s in self._seq.items() if dead is None or dead(n)}
        for s in gone:
            self.ctx.seq_rm(s, -1, -1)
            self._tail.pop(s, None)
            self._free.append(s)
        self._seq = {n: s for n, s in self._seq.items() if s not in gone}

    def forget(self, nodes: Sequence[Node]) -> None:
        """Frees the cells of ``nodes``; each comes with every decoded node below it."""
        cut: dict[int, int] = {}  # sequence -> the first position it gives up
        for node in nodes:
            seq = self._seq.pop(node, None)
            if seq is not None:
                cut[seq] = min(cut.get(seq, _pos(node)), _pos(node))
        for seq, pos in cut.items():
            kept = [n for n, s in self._seq.items() if s == seq]
            if kept:
                self.ctx.seq_rm(seq, pos, -1)
                self._tail[seq] = max(kept, key=_pos)
            else:  # its cells above the nodes it shares with other sequences go too
                self.ctx.seq_rm(seq, -1, -1)
                self._tail.pop(seq, None)
                self._free.append(seq)

    def _place(self, node: Node) -> int:
        """A sequence holding ``node``'s ancestors, now also naming ``node`` (decoded next)."""
        start, tokens = node
        parent = (start, tokens[:-1])
        if tokens[:-1] and parent not in self._seq:
            self._decode([parent])  # its cells were released: re-decode the path (rare)
        src = self._seq[parent] if tokens[:-1] else 0
        if src and self._tail.get(src) == parent:
            seq = src
        else:
            if not self._free:
                raise RuntimeError(f"no free sequence for a tree of {len(self._seq)} decoded nodes")
            seq = self._free.pop()
            self.ctx.seq_cp(src, seq, 0, _pos(node))
        self._seq[node] = seq
        self._tail[seq] = node
        return seq


def _pos(node: Node) -> int:
    """The position of a node's own cell."""
    return node[0] + len(node[1]) - 1
