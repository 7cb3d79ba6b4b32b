"""The offloaded 7B (a third of its weights + 256 MiB of VRAM) under three plans, all over plain
decoding of the 4-layer plan: `auto` drafting chains of 32 beside 4 GPU layers; `auto` drafting
trees of up to 63 nodes beside 3 layers, where a search that held every node it decoded
(256 sequences) left the target; and the same trees beside 4 layers, where a search that frees
what leaves its top (64 sequences, the chain drafter's context) leaves it: today's default.
Curves of both layouts measured in one call on one H100 machine (benchmarks/device/run.sh
beside): one pair in each of three calls, four in a fourth, three in a fifth on a slower host
(samples 9-11); a table per pair, and one on each layout's median curve (per batch size, the
median of the ten).

    .venv/bin/python benchmarks/replay/default_shape.py [--graphs per-shape|stock|none]
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace

import replay as rp
from heldout import overall
from simulate import add_graphs_flag, load_costs, load_traces, median_costs

# (4 GPU layers, 3 GPU layers) beside the drafter, each pair measured in one call
SAMPLES = (("offload-7b-beside-drafter-2", "offload-7b-beside-tree-drafter"),
           *((f"offload-7b-beside-drafter-{k}", f"offload-7b-beside-tree-drafter-{k}") for k in range(3, 12)))
TRACES = (("code-edit", 256), ("code-edit-validation-16", 256), ("specbench-30", 128), ("specbench-30-validate", 128),
          ("code-edit-test-16", 256), ("specbench-30-test", 128), ("specbench-30-test2", 128))




def costs_of(name: str | tuple[str, ...], graphs: str) -> rp.MachineCosts:
    """A placement's costs, or the median of several curves of one layout (a tuple of names)."""
    return load_costs(name, graphs=graphs) if isinstance(name, str) else median_costs(name, graphs)


def tokens_per_s(trace, config: str, costs, max_tokens: int, graphs: str) -> float:
    costs = replace(costs_of(costs, graphs), node_s=0.59e-3)
    return overall(trace, config, costs, max_tokens=max_tokens)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_graphs_flag(ap)
    graphs = ap.parse_args().graphs
    logging.basicConfig(level=logging.ERROR)
    traces = [(name, load_traces(name)[0], n) for name, n in TRACES]
    for four, three in SAMPLES + (tuple(zip(*SAMPLES)),):
        print(f"\n{four} / {three}\n" if isinstance(four, str) else f"\nmedian curves of the {len(SAMPLES)}\n")
        print("| trace (tokens) | plain, 4 layers tok/s | `auto` chains, 4 layers | `auto` trees, 3 layers "
              "| `auto` trees, 4 layers (default) |")
        print("|---|---|---|---|---|")
        for name, trace, n in traces:
            plain = tokens_per_s(trace, "plain", four, n, graphs)
            ratios = [tokens_per_s(trace, config, costs, n, graphs) / plain
                      for config, costs in (("auto", four), ("auto-tree", three), ("auto-tree", four))]
            print(f"| {name} ({n}) | {plain:.2f} | "
                  + " | ".join(f"{r:.2f}x" for r in ratios) + " |")


if __name__ == "__main__":
    main()
