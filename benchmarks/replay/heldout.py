"""Replays a trace on the GPU placements for a few configurations, over all its prompts and over
those not in another trace (the prompts never looked at before): overall speedups as a table.

    .venv/bin/python benchmarks/replay/heldout.py --trace code-edit-validation-16 \
        --seen code-edit-validation --configs auto,auto-tree,hybrid-tree
    .venv/bin/python benchmarks/replay/heldout.py --trace specbench-30-validate --seen specbench-30 \
        --configs auto,auto-tree --max-tokens 128
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace

import replay as rp
from placements import PLACEMENTS
from replay import TREE
from simulate import add_graphs_flag, load_costs, load_traces

from edgespec.bench.summary import OVERALL, summarize


def overall(trace, config: str, costs, ids=None, max_tokens: int | None = None) -> dict:
    """``config``'s overall summary (speedup over plain, tokens/s, ...) on the prompts ``ids``
    (None: all), replayed alone; trees draft up to 63 nodes, chains 32 tokens."""
    draft_max = 63 if config.endswith(TREE) else 32
    settings = rp.ReplaySettings(max_tokens=trace.max_tokens if max_tokens is None else max_tokens,
                                 draft_max=draft_max)
    configs = ["plain"] + ([config] if config != "plain" else [])
    return summarize(rp.replay(trace, configs, costs, settings, ids=ids))[config][OVERALL]


def speedup(trace, config: str, costs, ids, max_tokens: int | None = None) -> float:
    return overall(trace, config, costs, ids, max_tokens)["speedup"]


def speedup_cell(trace, configs, costs, max_tokens: int | None = None) -> str:
    """A table cell, "1.33x / 1.32x": each config's speedup on all of ``trace``'s prompts."""
    ids = [p.id for p in trace.prompts]
    return " / ".join(f"{speedup(trace, c, costs, ids, max_tokens):.2f}x" for c in configs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--seen", required=True, help="a trace whose prompts count as seen")
    ap.add_argument("--configs", default="auto,auto-tree,hybrid-tree")
    ap.add_argument("--placements", default=",".join(p for p in PLACEMENTS if p != "gpu-1.5b"))
    ap.add_argument("--node-ms", type=float, default=0.59)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the trace's; Spec-Bench trees are recorded for 128")
    add_graphs_flag(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    trace, seen = load_traces(f"{args.trace},{args.seen}")
    every = [p.id for p in trace.prompts]
    new = [i for i in every if i not in {p.id for p in seen.prompts}]
    configs = args.configs.split(",")
    print("| placement | " + " | ".join(f"{c}: all {len(every)} / new {len(new)}" for c in configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for name in args.placements.split(","):
        costs = replace(load_costs(name, graphs=args.graphs), node_s=args.node_ms * 1e-3)
        cells = [f"{speedup(trace, c, costs, every, args.max_tokens):.2f}x / "
                 f"{speedup(trace, c, costs, new, args.max_tokens):.2f}x" for c in configs]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
