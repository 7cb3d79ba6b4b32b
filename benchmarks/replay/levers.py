"""What `gpu` would reach if its costs changed: the held-out Spec-Bench sets replayed on a
placement's measured costs, then on the same costs with levers pulled, alone and together.

* graphs: no target or drafter decode pays for a change of batch size (a graph kept per shape
  *and* no ggml graph rebuilt on the CPU: what a cache of built graphs per ubatch would give);
  `auto`'s calibration still sees a size's first decodes without a graph, as it does today;
* columns F: a verification of 2-8 rows costs one row plus F times what mmvq charges today for
  the rows beyond the first (F = 0.5: half the per-column cost, as a tensor-core kernel for
  small batches might give);
* drafter D: every drafter decode costs D times the 0.5B's (D = 0.5: a drafter of half its
  depth that agrees as well, which only training could give; its graph misses unchanged).

Nothing is tuned here: the policy is the shipped one, on the shipped replay; it decides with
the changed costs, as its calibration would measure them.

    .venv/bin/python benchmarks/replay/levers.py --placements gpu-7b,gpu-14b [--census]
"""
from __future__ import annotations

import argparse
import logging
from collections import Counter
from dataclasses import replace

import replay as rp
from heldout import speedup_cell
from replay import CostModel, MachineCosts
from simulate import load_costs, load_traces

SETS = "specbench-30-test,specbench-30-test2,specbench-30-test3,specbench-30-test4"
MMVQ_MAX_ROWS = 8  # llama.cpp's MMVQ_MAX_BATCH_SIZE: larger batches go to mmq


def cheaper_columns(costs: MachineCosts, factor: float) -> MachineCosts:
    """``costs`` with the target's 2..8-row verifications at one row plus ``factor`` of the rest;
    9 rows and more (mmq) keep their cost, anchored at 9 so that no interpolation leaks the cut."""
    def scaled(c: CostModel) -> CostModel:
        one = c.verify_s[0]
        sizes = sorted({*c.batch_sizes, MMVQ_MAX_ROWS + 1})
        return CostModel(tuple(sizes), tuple(
            one + (c.verify(n) - one) * (factor if 1 < n <= MMVQ_MAX_ROWS else 1.0) for n in sizes))
    return replace(costs, target=tuple((d, scaled(c)) for d, c in costs.target))


def cheaper_drafter(costs: MachineCosts, factor: float) -> MachineCosts:
    """``costs`` with every drafter decode at ``factor`` of its cost (`auto` prices it so too)."""
    if costs.drafter is None:
        return costs
    return replace(costs, drafter=replace(costs.drafter, verify_s=tuple(s * factor for s in costs.drafter.verify_s)))


def no_graph_misses(costs: MachineCosts) -> MachineCosts:
    """``costs`` without graph misses; the calibration's miss kept (a size's first decodes)."""
    keep = costs.graph_miss_s[0] if costs.calibration_miss_s is None else costs.calibration_miss_s
    return replace(costs, graph_miss_s=(0.0, 0.0), calibration_miss_s=keep)


def census(trace, config: str, costs: MachineCosts) -> str:
    """How ``config``'s target decodes split by batch size, and how many paid a graph miss."""
    ledgers = []

    def ledger(c: MachineCosts) -> rp.Ledger:
        ledgers.append(SizeLedger(c))
        return ledgers[-1]
    settings = rp.ReplaySettings(max_tokens=128, draft_max=63 if config.endswith(rp.TREE) else 32)
    rp.replay(trace, [config], costs, settings, new_ledger=ledger)
    mine = ledgers[1::2]  # plain's and config's runs alternate, plain first
    sizes = Counter(n for led in mine for n in led.sizes)
    big = sum(c for n, c in sizes.items() if n > 8)
    return (f"{sum(sizes.values())} target decodes: " + ", ".join(f"{sizes[n]} of {n}" for n in range(1, 9))
            + f", {big} larger; {sum(led.graph_misses[0] for led in mine)} paid a graph miss")


class SizeLedger(rp.Ledger):
    """A ledger that also keeps the size of every target decode."""

    def __init__(self, costs: MachineCosts):
        super().__init__(costs)
        self.sizes: list[int] = []

    def target(self, n: int, depth: int) -> None:
        self.sizes.append(n)
        super().target(n, depth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placements", default="gpu-7b")
    ap.add_argument("--traces", default=SETS)
    ap.add_argument("--configs", default="auto,auto-tree")
    ap.add_argument("--columns", type=float, default=0.5, help="F: the 2-8 row cost beyond one row, scaled")
    ap.add_argument("--drafter", type=float, default=0.5, help="D: the drafter's decodes, scaled")
    ap.add_argument("--node-ms", type=float, default=0.35, help="a tree node's Python (benchmarks/results/logits-rows.json)")
    ap.add_argument("--pick-ms", type=float, default=0.21, help="a chain's greedy pick in Python (benchmarks/results/logits-rows.json)")
    ap.add_argument("--census", action="store_true", help="also: the shipped build's target decodes by size")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    traces = load_traces(args.traces)
    configs = args.configs.split(",")
    print("| placement | costs | " + " | ".join(args.traces.split(",")) + " |")
    print("|---" * (len(traces) + 2) + "|")
    for name in args.placements.split(","):
        shipped = replace(load_costs(name, graphs="per-shape"), node_s=args.node_ms * 1e-3, pick_s=args.pick_ms * 1e-3)
        no_miss = no_graph_misses(shipped)
        cols, draft = f"2-8 rows x{args.columns:g}", f"drafter x{args.drafter:g}"
        for label, costs in (("shipped build", shipped), ("no graph misses", no_miss),
                             (cols, cheaper_columns(shipped, args.columns)),
                             (draft, cheaper_drafter(shipped, args.drafter)),
                             ("no graph misses, " + cols, cheaper_columns(no_miss, args.columns)),
                             ("all three", cheaper_drafter(cheaper_columns(no_miss, args.columns), args.drafter))):
            cells = [speedup_cell(t, configs, costs, 128) for t in traces]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")
    if args.census:
        for name in args.placements.split(","):
            costs = replace(load_costs(name, graphs="per-shape"), node_s=args.node_ms * 1e-3, pick_s=args.pick_ms * 1e-3)
            for trace_name, trace in zip(args.traces.split(","), traces):
                for config in configs:
                    print(f"- {name}, {trace_name}, {config}: {census(trace, config, costs)}")


if __name__ == "__main__":
    main()
