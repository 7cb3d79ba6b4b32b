"""Adds best-first model-tree records (replay_trees.py) to recorded traces.

The prompts and plain outputs come from an existing trace (benchmarks/replay/record.py); only
the drafter model runs here, at every output position, for every budget of the menu.

    flock /tmp/edgespec-bench.lock .venv/bin/python benchmarks/replay/record_trees.py \
        --trace benchmarks/replay/traces/specbench-30.json.gz [--max-tokens 256] [--ids a,b]
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

import replay as rp
import replay_trees as rt

from edgespec.bench.machine import describe
from edgespec.files.store import ModelStore
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel

log = logging.getLogger("record_trees")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True, help="read and rewritten in place")
    ap.add_argument("--max-tokens", type=int, default=None, help="positions recorded per prompt (default: all)")
    ap.add_argument("--ids", default=None, help="only these prompt ids (comma list)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trace = rp.load_trace(args.trace)
    path = ModelStore().resolve(trace.meta["draft_model"])
    n_ctx = max(len(p.prompt) + len(p.output) for p in trace.prompts) + 8192
    model = LlamaModel(path)
    ctx = LlamaContext(model, ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                            n_seq_max=rt.MAX_EXPANSIONS + 1, n_threads=args.threads))
    wanted = None if args.ids is None else set(args.ids.split(","))
    prompts = list(trace.prompts)
    meta = dict(trace.meta, trees={"budgets": list(rt.TREE_SIZES), "machine": describe(ctx.n_threads),
                                   "max_tokens": args.max_tokens, "record_s": {}})
    try:
        for k, p in enumerate(prompts):
            if wanted is not None and p.id not in wanted or p.trees is not None:
                continue
            t0 = time.perf_counter()
            output = p.output[:args.max_tokens] if args.max_tokens else p.output
            trees = rt.record_trees(ctx, p.prompt, output)
            prompts[k] = dataclasses.replace(p, trees=trees)
            meta["trees"]["record_s"][p.id] = time.perf_counter() - t0
            rp.save_trace(rp.Trace(trace.suite, trace.max_tokens, tuple(prompts), meta), args.trace)
            big = [a[-1] for a in trees.accepted]
            log.info("%d/%d %s: %d positions, accepted at %d nodes %.2f / position, %d expansions, %.1f s",
                     k + 1, len(prompts), p.id, len(output), trees.budgets[-1], sum(big) / max(len(big), 1),
                     sum(e[-1] for e in trees.expansions), time.perf_counter() - t0)
    finally:
        ctx.close()
        model.close()


if __name__ == "__main__":
    main()
