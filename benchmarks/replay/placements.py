"""Replays traces on every GPU placement at once: overall speedup per configuration, plus the
ceiling of any draft-size policy (ceiling.py), as one JSON file and one table.

    .venv/bin/python benchmarks/replay/placements.py --traces specbench-30,code-edit \
        --configs plain,suffix,model,hybrid,auto --json out.json
    # trees (chains are recorded to 32 tokens: no `auto` here): --configs plain,hybrid-tree,auto-tree \
    #     --draft-max 63 --node-ms 0.59 --ceiling model,tree,suffix

Each (trace, placement) is one replay in the bench's order (every configuration per prompt, one
shared drafter cache, auto's memory carried from prompt to prompt); seconds, no model.
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

import replay as rp
from ceiling import CEILING, ceiling_record
from simulate import add_graphs_flag, load_costs, load_traces

from edgespec.bench.summary import OVERALL, summarize

PLACEMENTS = ("gpu-1.5b", "gpu-7b", "offload-7b", "offload-7b-beside-drafter", "draft-gpu-7b")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--configs", default="plain,suffix,model,hybrid,auto")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--ceiling", default="model,suffix", help="sources of the ceiling row ('' for none)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-max", type=int, default=32, help="63 for trees (the largest 63 nodes)")
    ap.add_argument("--node-ms", type=float, default=None,
                    help="Python-side milliseconds per tree node expanded (simulate.py's --node-ms)")
    ap.add_argument("--json", type=Path)
    add_graphs_flag(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = rp.ReplaySettings(max_tokens=args.max_tokens, draft_max=args.draft_max)
    replayed = ["plain"] + [c for c in args.configs.split(",") if c != "plain"]
    columns = replayed[1:] + ([CEILING] if args.ceiling else [])
    out: dict[str, dict] = {}
    print("| trace | placement | plain tok/s | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 3) + "|")
    for label, trace in zip(args.traces.split(","), load_traces(args.traces)):
        label = Path(label).name.removesuffix(".json.gz")
        for name in args.placements.split(","):
            costs = load_costs(name, graphs=args.graphs)
            if args.node_ms is not None:
                costs = replace(costs, node_s=args.node_ms * 1e-3)
            records = rp.replay(trace, replayed, costs, settings)
            if args.ceiling:
                records += [ceiling_record(p, costs, settings, args.ceiling.split(",")) for p in trace.prompts]
            cells = {cfg: v[OVERALL] for cfg, v in summarize(records).items()}
            out[f"{label}|{name}"] = cells
            print(f"| {label} | {name} | {cells['plain']['tokens_per_s']:.1f} | "
                  + " | ".join(f"{cells[c]['speedup']:.2f}x ({cells[c]['mean_emitted'] or 1:.1f})" for c in columns) + " |")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(settings), "ceiling": args.ceiling, "results": out}, indent=1))


if __name__ == "__main__":
    main()
