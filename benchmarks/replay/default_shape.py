"""The offloaded 7B's default plan against the chains plan it replaces: `auto` drafting trees of
up to 63 nodes beside a target left 3 GPU layers (the tree search's context takes the fourth),
`auto` drafting chains of 32 beside 4 layers, both over plain decoding of the 4-layer plan.
Curves of both layouts measured on one H100 machine (benchmarks/device/run.sh beside).

    .venv/bin/python benchmarks/replay/default_shape.py
"""
from __future__ import annotations

import logging
from dataclasses import replace

from heldout import overall
from simulate import load_costs, load_traces

CHAINS, TREES = "offload-7b-beside-drafter-2", "offload-7b-beside-tree-drafter"
TRACES = (("code-edit", 256), ("code-edit-validation-16", 256), ("specbench-30", 128), ("specbench-30-validate", 128))


def tokens_per_s(trace, config: str, costs: str, max_tokens: int) -> float:
    return overall(trace, config, replace(load_costs(costs), node_s=0.59e-3), max_tokens=max_tokens)["tokens_per_s"]


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    print("| trace (tokens) | plain, 4 layers tok/s | `auto` chains, 4 layers | `auto` trees, 3 layers (default) |")
    print("|---|---|---|---|")
    for name, n in TRACES:
        trace, = load_traces(name)
        plain = tokens_per_s(trace, "plain", CHAINS, n)
        chains, trees = tokens_per_s(trace, "auto", CHAINS, n), tokens_per_s(trace, "auto-tree", TREES, n)
        print(f"| {name} ({n}) | {plain:.2f} | {chains / plain:.2f}x | {trees / plain:.2f}x |")


if __name__ == "__main__":
    main()
