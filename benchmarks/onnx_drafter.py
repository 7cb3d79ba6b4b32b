"""ONNX drafter (exact and 4-bit) vs the llama.cpp drafter, side by side on one machine.

For each drafter, in a fresh subprocess (so peak RSS is its own): load, prefill ~500 tokens of a
real code-edit request, then time greedy chains of 8 drafted tokens and best-first trees of 16
nodes continuing that context (each proposal re-syncs the context as in a speculative run:
the last context token is decoded again). Also the share of positions where its greedy next
token equals the llama.cpp drafter's over that context.

Run under the benchmark lock on a shared machine:
    flock /tmp/edgespec-bench.lock .venv/bin/python benchmarks/onnx_drafter.py
Writes benchmarks/results/onnx-drafter.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DRAFTER = "qwen2.5-coder-0.5b"
CONFIGS = ("llama.cpp", "onnx-exact", "onnx-4bit")
CONTEXT_TOKENS = 500
CHAIN = 8
TREE = 16
REPEATS = 5


def _context(model) -> list[int]:
    from edgespec.bench.prompts import SUITES

    lines = SUITES["code-edit"].read_text(encoding="utf-8").splitlines()
    text = "\n".join(json.loads(line)["turns"][0] for line in lines[:3])
    return model.tokenize(text)[:CONTEXT_TOKENS]


def _drafter(config: str, model, store, threads: int):
    if config == "llama.cpp":
        from edgespec.drafters.model import ModelDrafter

        return ModelDrafter(model, n_ctx=2048, n_threads=threads, min_confidence=0.0)
    from edgespec.drafters.onnx import OnnxDrafter
    from edgespec.onnx.convert import convert
    from edgespec.onnx.session import OnnxLM

    directory = convert(store, DRAFTER, "exact" if config == "onnx-exact" else "4")
    return OnnxDrafter(OnnxLM(directory, "cpu", n_ctx=2048, n_threads=threads), min_confidence=0.0)


def _time(drafter, context: list[int], budget: int, tree: bool) -> tuple[list[float], int]:
    drafter.tree = tree
    times, nodes = [], 0
    for _ in range(REPEATS):
        start = time.perf_counter()
        draft = drafter.propose(context, budget)
        times.append(time.perf_counter() - start)
        nodes = len(draft)
    return times, nodes


def _onnx_argmax(drafter, context: list[int]) -> np.ndarray:
    drafter.cached = []
    n = len(context)
    rows = [drafter.lm.forward(context[s:s + 128], range(s, min(s + 128, n)), s,
                               rows=range(min(128, n - s))).argmax(-1) for s in range(0, n, 128)]
    drafter.cached = list(context)
    return np.concatenate(rows)


def _llama_argmax(model, context: list[int]) -> np.ndarray:
    from edgespec.llama.backend import ContextParams, LlamaContext

    ctx = LlamaContext(model, ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2))
    n = len(context)
    out = ctx.decode(context, range(n), [[0]] * n, [True] * n).argmax(-1)
    ctx.close()
    return out


def run_one(config: str, threads: int, shared: Path) -> dict:
    """Everything measured for one drafter, in this process.

    The llama.cpp run (first) leaves the context and its greedy tokens in ``shared``, so the
    ONNX runs never load llama.cpp and their peak RSS is their own.
    """
    from edgespec.files.store import ModelStore

    store = ModelStore()
    model = None
    if config == "llama.cpp":
        from edgespec.llama.backend import LlamaModel

        model = LlamaModel(store.resolve(DRAFTER))
        context = _context(model)
        np.savez(shared, context=np.asarray(context), argmax=_llama_argmax(model, context))
    saved = np.load(shared)
    context, reference = [int(t) for t in saved["context"]], saved["argmax"]
    start = time.perf_counter()
    drafter = _drafter(config, model, store, threads)
    load_s = time.perf_counter() - start
    drafter.begin(context)
    start = time.perf_counter()
    drafter.propose(context, 1)
    prefill_s = time.perf_counter() - start
    chain, chain_nodes = _time(drafter, context, CHAIN, tree=False)
    tree, tree_nodes = _time(drafter, context, TREE, tree=True)
    agreement = None if model is not None else float((_onnx_argmax(drafter, context) == reference).mean())
    return {
        "config": config, "threads": threads, "context_tokens": len(context),
        "load_s": load_s, "prefill_s": prefill_s,
        "ms_per_drafted_token": 1000 * min(chain) / chain_nodes, "chain_nodes": chain_nodes,
        "ms_per_tree": 1000 * min(tree), "tree_nodes": tree_nodes,
        "chain_s_all": chain, "tree_s_all": tree,
        "drafter_nbytes": drafter.nbytes,
        "greedy_agreement_with_llama_cpp": agreement,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=CONFIGS, help="measure one drafter here (internal)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shared", default="/tmp/edgespec-onnx-bench.npz", help="(internal)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "onnx-drafter.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.threads, Path(args.shared))))
        return
    records, load = [], [os.getloadavg()[0]]
    for config in CONFIGS:
        r = subprocess.run([sys.executable, __file__, "--one", config, "--threads", str(args.threads),
                            "--shared", args.shared],
                           capture_output=True, text=True, check=True)
        records.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"{config:11s} {records[-1]['ms_per_drafted_token']:6.1f} ms/token "
              f"{records[-1]['ms_per_tree']:7.1f} ms/tree({records[-1]['tree_nodes']}) "
              f"peak RSS {records[-1]['peak_rss_bytes'] / 2**20:6.0f} MiB", file=sys.stderr)
        load.append(os.getloadavg()[0])
    import onnxruntime

    machine = {"platform": platform.platform(), "processor": platform.processor(),
               "cpus": os.cpu_count(), "onnxruntime": onnxruntime.__version__,
               # other engineers' jobs share the machine: 1-minute load before and after each config
               "load_average_1m": load}
    Path(args.out).write_text(json.dumps({"machine": machine, "records": records}, indent=2) + "\n")


if __name__ == "__main__":
    main()
