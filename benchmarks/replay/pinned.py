"""The offloaded 7B with its CPU-resident weights pinned in host memory instead of mapped from
the file, by op offload threshold: replayed speedups over plain decoding of the same curve.

Curves from two calls on one H100 machine each, 2026-11-28 (benchmarks/device/run.sh pinned,
then pinned2): the 4-layer layout beside the drafter mapped (`-12`), pinned at llama.cpp's
threshold of 32, and pinned at 2 and at 1 (three samples each: one in the first call, two in the
second); the 9-layer layout (a third of the weights, the drafter on top) mapped and pinned at 2.
Plain decoding's step (consecutive one-token decodes, the ``chain`` figure) varied 87-123 ms
between these processes, slower from pinned than from mapped weights on the CPU path, so every
ratio is also given against plain decoding at the fastest one-token cost measured on the layout
in these calls, mapped or pinned, any threshold (``floor``: that plain step against the median
pinned curve's drafting steps), a lower bound. A drafter decode that cannot replay its CUDA graph
costs what ``measure.py mixed`` measured (results/mixed.json), as in simulate.load_costs.

    .venv/bin/python benchmarks/replay/pinned.py [--graphs per-shape|stock|none]
"""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace

import replay as rp
from heldout import overall
from simulate import DEVICE_CURVES, add_graphs_flag, load_traces, median_costs

BESIDE = "offload-7b-beside-drafter"
LAYOUTS = {  # name: (mapped curve, pinned samples at the threshold edgespec sets)
    "4 layers beside the drafter, threshold 2": (f"{BESIDE}-12", tuple(
        f"{BESIDE}-pinned-ob2{s}" for s in ("", "-2", "-3"))),
    "4 layers beside the drafter, threshold 1": (f"{BESIDE}-12", tuple(
        f"{BESIDE}-pinned-ob1{s}" for s in ("", "-2", "-3"))),
    "4 layers beside the drafter, threshold 32 (llama.cpp's)": (f"{BESIDE}-12", (f"{BESIDE}-pinned",)),
    "9 layers, the drafter on top, threshold 2": ("offload-7b-12", ("offload-7b-pinned-ob2",)),
}
TRACES = (("code-edit-test-16", 256), ("specbench-30-test", 128), ("specbench-30-test2", 128),
          ("specbench-30-test3", 128), ("specbench-30-test4", 128), ("code-edit", 256), ("code-edit-validation-16", 256),
          ("specbench-30", 128), ("specbench-30-validate", 128))
CONFIGS = ("auto", "auto-tree")  # chains of 32; the default (trees of up to 63 nodes)


def costs(curves: dict, names: tuple[str, ...], graphs: str, one_token_ms: float | None = None) -> rp.MachineCosts:
    """The median curve of ``names`` (per batch size), its one-token cost optionally replaced."""
    return replace(median_costs(names, graphs, one_token_ms=one_token_ms, curves=curves), node_s=0.59e-3)


def _layout_samples(curves: dict, mapped: str) -> list[str]:
    """Every curve of ``mapped``'s layout measured in these two calls, mapped or pinned."""
    stem = mapped.removesuffix("-12")
    return [k[6:-5] for k, v in curves.items() if "2026-11-28" in v.get("measured", "")
            and (k[6:-5] == mapped or k[6:-5].startswith(f"{stem}-pinned"))]


def tokens_per_s(trace, config: str, c: rp.MachineCosts, max_tokens: int) -> float:
    return overall(trace, config, c, max_tokens=max_tokens)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_graphs_flag(ap)
    graphs = ap.parse_args().graphs
    logging.basicConfig(level=logging.ERROR)
    curves = json.loads(DEVICE_CURVES.read_text())
    traces = [(name, load_traces(name)[0], n) for name, n in TRACES]
    for layout, (mapped, pinned) in LAYOUTS.items():
        samples = [curves[f"curve-{n}.json"] for n in _layout_samples(curves, mapped)]
        fastest = min(min(e["chain_ms_per_token"], *(p["ms"] for p in e["curve"] if p["n"] == 1)) for e in samples)
        print(f"\n### {layout}\n\nover plain decoding of the same curve; `floor`: over plain at {fastest:.1f} ms "
              f"a token; pinned: the median of {len(pinned)} curve(s)" + (", [range over them]" if len(pinned) > 1 else "")
              + "\n")
        print("| trace (tokens) | plain mapped tok/s | mapped: chains / trees | pinned: chains / trees "
              "| pinned `floor`: chains / trees |")
        print("|---|---|---|---|---|")
        m_costs, p_costs = costs(curves, (mapped,), graphs), costs(curves, pinned, graphs)
        floor_plain = costs(curves, pinned, graphs, fastest)
        for name, trace, n in traces:
            m_plain, p_plain = tokens_per_s(trace, "plain", m_costs, n), tokens_per_s(trace, "plain", p_costs, n)
            f_plain = tokens_per_s(trace, "plain", floor_plain, n)
            cells = [" / ".join(f"{tokens_per_s(trace, c, m_costs, n) / m_plain:.2f}x" for c in CONFIGS)]
            spec = {c: tokens_per_s(trace, c, p_costs, n) for c in CONFIGS}
            pinned_cell = " / ".join(f"{spec[c] / p_plain:.2f}x" for c in CONFIGS)
            if len(pinned) > 1:
                each = [(e, tokens_per_s(trace, "plain", e, n)) for e in (costs(curves, (s,), graphs) for s in pinned)]
                ranges = []
                for c in CONFIGS:
                    rs = [tokens_per_s(trace, c, e, n) / plain for e, plain in each]
                    ranges.append(f"{min(rs):.2f}-{max(rs):.2f}")
                pinned_cell += f" [{' / '.join(ranges)}]"
            cells += [pinned_cell, " / ".join(f"{spec[c] / f_plain:.2f}x" for c in CONFIGS)]
            print(f"| {name} ({n}) | {m_plain:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
