"""Replays recorded traces against a named cost model: steps, tokens/s and speedups per config.

    .venv/bin/python benchmarks/replay/simulate.py --costs gpu-7b --traces specbench-30,code-edit \
        --configs plain,suffix,model,hybrid,auto [--max-tokens 256] [--draft-max 32] [--json out.json] \
        [--ceiling model,tree,suffix]

``--costs``: a JSON file in replay.costs_from_json's format, ``cpu-dev`` (this
development VM, benchmarks/replay/costs/cpu-dev.json, measured by measure_cpu.py), or a
placement of benchmarks/device/results/curves.json (``PLACEMENTS`` below). Replay needs no
model and no lock; it takes seconds. ``--ceiling SOURCES`` adds the row ``ceiling``: the best any
draft-size policy could do with those recorded drafts (ceiling.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import replay as rp
from ceiling import SOURCES, ceiling_record

from edgespec.bench.report import _cell
from edgespec.bench.summary import OVERALL, PLAIN, summarize

HERE = Path(__file__).resolve().parent
DEVICE_CURVES = HERE.parent / "device" / "results" / "curves.json"
# measure.py mixed on H100s (2026-11-28): what a decode costs without its CUDA graph, on a stock
# llama.cpp (mixed-CONFIG.json) and on edgespec's patched build (mixed-CONFIG-per-shape.json)
DEVICE_MIXED = HERE.parent / "device" / "results" / "mixed.json"
# name: (target curve, drafter curve) in DEVICE_CURVES (H100 machine, 8 CPU threads)
PLACEMENTS = {
    "gpu-1.5b": ("gpu-1.5b", "gpu-0.5b"),
    "gpu-7b": ("gpu-7b", "gpu-0.5b"),
    # Qwen2.5-14B and -32B shapes (2026-11-28, one H100 machine): where the 0.5B drafter's token
    # is a fifth and a tenth of a target step
    "gpu-14b": ("gpu-14b", "gpu-0.5b"),
    "gpu-32b": ("gpu-32b", "gpu-0.5b"),
    "offload-7b": ("offload-7b", "gpu-0.5b"),  # 9 GPU layers (a third of the weights), op offload
    "offload-7b-ngl11": ("offload-7b-ngl11", "gpu-0.5b"),
    # 4 layers: what the planner leaves the 7B when the drafter shares the third (engine_modes.py)
    "offload-7b-beside-drafter": ("offload-7b-beside-drafter", "gpu-0.5b"),
    # the same 4 layers and the 3 the planner left beside a 256-sequence tree drafter (150 MiB
    # more), measured in one call on one H100 machine each (RESULTS-gpu.md sections 12 and 13)
    "offload-7b-beside-drafter-2": ("offload-7b-beside-drafter-2", "gpu-0.5b"),
    "offload-7b-beside-tree-drafter": ("offload-7b-beside-tree-drafter", "gpu-0.5b"),
    "offload-7b-beside-drafter-3": ("offload-7b-beside-drafter-3", "gpu-0.5b"),
    "offload-7b-beside-tree-drafter-3": ("offload-7b-beside-tree-drafter-3", "gpu-0.5b"),
    "offload-7b-beside-drafter-4": ("offload-7b-beside-drafter-4", "gpu-0.5b"),
    "offload-7b-beside-tree-drafter-4": ("offload-7b-beside-tree-drafter-4", "gpu-0.5b"),
    **{f"offload-7b-beside-{kind}-{k}": (f"offload-7b-beside-{kind}-{k}", "gpu-0.5b")
       for kind in ("drafter", "tree-drafter") for k in range(5, 12)},  # four runs of one call, three of another
    "offload-7b-no-op-offload": ("offload-7b-no-op-offload", "gpu-0.5b"),
    # one call on one H100 machine (2026-11-28): the two layouts with mapped weights, then with
    # their CPU-resident weights pinned (no mmap), beside the drafter by op offload threshold
    "offload-7b-12": ("offload-7b-12", "gpu-0.5b"),
    "offload-7b-pinned": ("offload-7b-pinned", "gpu-0.5b"),
    "offload-7b-beside-drafter-12": ("offload-7b-beside-drafter-12", "gpu-0.5b"),
    "offload-7b-beside-drafter-pinned": ("offload-7b-beside-drafter-pinned", "gpu-0.5b"),
    **{f"offload-7b-beside-drafter-pinned-ob{n}": (f"offload-7b-beside-drafter-pinned-ob{n}", "gpu-0.5b")
       for n in (1, 2, 4, 8, 16)},
    "draft-gpu-7b": ("cpu-7b", "gpu-0.5b"),  # Dovetail: target on the CPU, drafter on the GPU
    "draft-gpu-1.5b": ("cpu-1.5b", "gpu-0.5b"),
    "cpu-7b": ("cpu-7b", "cpu-0.5b"),
    "cpu-1.5b": ("cpu-1.5b", "cpu-0.5b"),
}


# How GPU decodes meet llama.cpp's CUDA graphs: a graph per batch shape (the llama.cpp edgespec
# builds, native/llama_cpp_patches.py), one per context (a stock build), or every decode at its
# curve's cost (as if each replayed a graph).
GRAPHS = ("per-shape", "stock", "none")


def _mixed(graphs: str) -> dict | None:
    if graphs not in GRAPHS:
        raise ValueError(f"graphs must be one of {', '.join(GRAPHS)}, not {graphs!r}")
    return json.loads(DEVICE_MIXED.read_text()) if graphs != "none" else None


def load_costs(name: str, graphs: str = "per-shape") -> rp.MachineCosts:
    """A cost model by placement name, ``cpu-dev``, or JSON path. ``graphs`` (one of GRAPHS):
    what a GPU decode that cannot replay a CUDA graph costs, from DEVICE_MIXED."""
    if name in PLACEMENTS:
        target, drafter = PLACEMENTS[name]
        mixed, per_shape = _mixed(graphs), graphs == "per-shape"
        if mixed is not None and target.startswith("gpu-") and rp.mixed_key(target, per_shape) not in mixed:
            logging.getLogger("simulate").warning("%s: no graph misses measured for %s (%s); its decodes "
                                                  "are booked at the curve", name, target, graphs)
        return rp.costs_from_device_curves(json.loads(DEVICE_CURVES.read_text()), target, drafter, name,
                                           mixed=mixed, per_shape=per_shape)
    path = HERE / "costs" / f"{name}.json" if not name.endswith(".json") else Path(name)
    return rp.costs_from_json(json.loads(path.read_text()), name)


def median_costs(names: Sequence[str], graphs: str = "per-shape", one_token_ms: float | None = None,
                 curves: dict | None = None) -> rp.MachineCosts:
    """Costs of the per-batch-size median of several curves of one layout (names in
    DEVICE_CURVES, drafter "gpu-0.5b"), named after them; ``one_token_ms`` replaces its one-token
    cost (plain decoding's step: rp.device_curve takes the chain figure); ``graphs`` as in load_costs."""
    curves = curves if curves is not None else json.loads(DEVICE_CURVES.read_text())
    entries = [curves[f"curve-{n}.json"] for n in names]
    points = [{"n": n, "ms": statistics.median(p["ms"] for e in entries for p in e["curve"] if p["n"] == n)}
              for n in sorted({p["n"] for p in entries[0]["curve"]})]
    median = {"curve": points,
              **{k: statistics.median(e[k] for e in entries) for k in ("chain_ms_per_token", "prefill_512_ms")}}
    if one_token_ms is not None:
        points[0], median["chain_ms_per_token"] = {"n": 1, "ms": one_token_ms}, one_token_ms
    return rp.costs_from_device_curves({"curve-median.json": median, **curves}, "median", "gpu-0.5b",
                                       ",".join(names), mixed=_mixed(graphs), per_shape=graphs == "per-shape")


def add_graphs_flag(ap: argparse.ArgumentParser) -> None:
    """``--graphs {per-shape,stock,none}``: load_costs(graphs=...) for every placement."""
    ap.add_argument("--graphs", choices=GRAPHS, default="per-shape",
                    help="CUDA graphs kept per batch shape (edgespec's llama.cpp build), per context "
                         "(a stock build), or none (every GPU decode at its curve's cost)")


def load_traces(names: str) -> list[rp.Trace]:
    return [rp.load_trace(n if n.endswith(".gz") else HERE / "traces" / f"{n}.json.gz") for n in names.split(",")]


def table(records, title: str) -> str:
    summary = summarize(records)
    cats = [c for c in summary[PLAIN] if c != OVERALL] + [OVERALL]
    lines = [f"### {title}", "", "| config | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for cfg, cells in summary.items():
        lines.append(f"| {cfg} | " + " | ".join(_cell(cells.get(c)) for c in cats) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--costs", required=True)
    ap.add_argument("--traces", default="specbench-30,code-edit")
    ap.add_argument("--configs", default="plain,suffix,model,hybrid,auto")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-max", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=None,
                    help="Python-side milliseconds per step on top of the decodes (default: the cost file's)")
    ap.add_argument("--node-ms", type=float, default=None,
                    help="Python-side milliseconds per tree node expanded (0.59 on the H200 machine's CPU, "
                         "benchmarks/device/results/engine-trees.json)")
    ap.add_argument("--ceiling", default=None, metavar="SOURCES",
                    help=f"add the oracle policy's row over these recorded drafts (of {','.join(SOURCES)})")
    ap.add_argument("--json", type=Path)
    add_graphs_flag(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    costs = load_costs(args.costs, graphs=args.graphs)
    if args.step_ms is not None:
        costs = replace(costs, step_s=args.step_ms * 1e-3)
    if args.node_ms is not None:
        costs = replace(costs, node_s=args.node_ms * 1e-3)
    settings = rp.ReplaySettings(max_tokens=args.max_tokens, draft_max=args.draft_max)
    out = {}
    for trace in load_traces(args.traces):
        records = rp.replay(trace, args.configs.split(","), costs, settings)
        if args.ceiling:
            records += [ceiling_record(p, costs, settings, args.ceiling.split(",")) for p in trace.prompts]
        print(table(records, f"{trace.suite} on {costs.name} (replayed, {len(trace.prompts)} prompts, "
                             f"{args.max_tokens} tokens)"))
        out[trace.suite] = {"records": [r.to_dict() for r in records], "summary": summarize(records)}
    if args.json:
        args.json.write_text(json.dumps({"costs": args.costs, "settings": vars(settings), "suites": out}, indent=1))


if __name__ == "__main__":
    main()
