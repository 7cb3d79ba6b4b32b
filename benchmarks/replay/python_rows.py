"""What the drafter's Python costs the replayed speedups: every held-out set replayed with a
chain's greedy picks and a tree's expanded nodes priced as drafting computed them before
(log-probabilities of the whole row in float64) and as it computes them now
(edgespec.decode.sampling.logsumexp, sampling.top_ids), against the replays' usual pricing
(picks free, 0.59 ms a node as measured on the H200 machine's CPU with the float64 code).

The prices are benchmarks/logits_rows.py's on the development VM with llama.cpp loaded
(benchmarks/results/logits-rows.json: picks 0.54 -> 0.21 ms, nodes 0.60 -> 0.35 ms), standing in
for the GPU machine's CPU, where the float64 node measured 0.59 ms in the engine (RESULTS-gpu.md
section 8). Policy unchanged; `auto`'s calibration counts the pick in a drafted token.

    .venv/bin/python benchmarks/replay/python_rows.py [--placements gpu-7b,gpu-14b,draft-gpu-7b]
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from heldout import speedup_cell
from levers import SETS
from pinned import LAYOUTS
from simulate import load_costs, load_traces, median_costs

PRICES = {  # label: (pick ms, node ms)
    "replays so far (picks free, nodes 0.59 ms)": (0.0, 0.59),
    "before (float64 rows: picks 0.54, nodes 0.60 ms)": (0.54, 0.60),
    "now (picks 0.21, nodes 0.35 ms)": (0.21, 0.35),
    # the GPU machine's CPU, timed without llama.cpp in the process (run.sh rows), where this
    # VM's float64 rows ran 2.7x slower than beside a decoding llama.cpp: an upper bound
    "now, H200 host bound (picks 0.40, nodes 0.69 ms)": (0.40, 0.69),
}
OFFLOAD = "4 layers beside the drafter, threshold 2"


def costs_of(name: str):
    if name == "offload-7b":  # pinned.py's layout: the shipped plan's 4 layers, pinned, threshold 2
        return median_costs(LAYOUTS[OFFLOAD][1], "per-shape")
    return load_costs(name, graphs="per-shape")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placements", default="gpu-7b,gpu-14b,draft-gpu-7b,offload-7b")
    ap.add_argument("--traces", default=SETS + ",code-edit-test-16")
    ap.add_argument("--configs", default="auto,auto-tree")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    names = args.traces.split(",")
    traces = load_traces(args.traces)
    configs = args.configs.split(",")
    print("| placement | Python priced | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for name in args.placements.split(","):
        base = costs_of(name)
        for label, (pick_ms, node_ms) in PRICES.items():
            costs = replace(base, pick_s=pick_ms * 1e-3, node_s=node_ms * 1e-3)
            cells = [speedup_cell(t, configs, costs, 256 if trace_name.startswith("code-edit") else 128)
                     for trace_name, t in zip(names, traces)]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
