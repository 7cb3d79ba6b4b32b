"""Which tree sizes `auto --draft-tree` drafts on the offloaded 7B's curves: replays one trace
beside 4 and beside 3 GPU layers (default_shape.py's curve samples, ``m``: their median) and
counts TreeSizes' choices (0: no tree that step). Speedups over plain of the 4-layer plan.

    .venv/bin/python benchmarks/replay/tree_sizes.py code-edit-validation-16 256 m 7
"""
from __future__ import annotations

import collections
import logging
import sys

from edgespec.drafters.auto import policy

import default_shape as ds


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    counts: collections.Counter = collections.Counter()
    choose = policy.TreeSizes.choose

    def counted(self, cost, limit, margin=policy.MARGIN):
        size = choose(self, cost, limit, margin)
        counts[size] += 1
        return size

    policy.TreeSizes.choose = counted
    name, n, samples = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    trace, = ds.load_traces(name)
    pairs = {"m": tuple(zip(*ds.SAMPLES)), **{str(k + 2): pair for k, pair in enumerate(ds.SAMPLES)}}
    for k in samples:
        four, three = pairs[k]
        plain = ds.tokens_per_s(trace, "plain", four, n)
        for layers, costs in (("4", four), ("3", three)):
            counts.clear()
            ratio = ds.tokens_per_s(trace, "auto-tree", costs, n) / plain
            print(f"sample {k}, {layers} layers: {ratio:.2f}x, sizes {sorted(counts.items())}")


if __name__ == "__main__":
    main()
