"""What `auto` decides on a placement, step by step, and what its calibration measured there.

    auto_diag.py TARGET OUT.json [PLACEMENT [THREADS [LIMIT [TOKENS]]]]

Loads TARGET with ``--draft auto`` on PLACEMENT as `edgespec run` does, prints the cost model
`auto` calibrated (verify seconds per batch size, seconds per drafted token, whether a drafter
model is loaded), times each batch size over several consecutive decodes (steady, with the
graph a size keeps) and alternating with one-token decodes (as verification follows plain
steps), then generates held-out code edits greedily and counts every step's choice: the
suffix draft on offer, the prefix verified, the model's plan, what the verifier got.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter

from edgespec.bench.prompts import load_suite, select
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.drafters.auto import calibrate
from edgespec.drafters.auto.drafter import AutoDrafter
from edgespec.drafters.auto.policy import best_tree_prefix
from edgespec.engine import Engine, EngineConfig
from edgespec.files.store import ModelStore

SIZES = (1, 2, 4, 8, 16, 32)


def decode_times(ctx, repeats: int = 6) -> dict:
    """Per size: every one of ``repeats`` consecutive decodes (ms), the same size decoded right
    after a one-token decode (the shape changes every time), and the one-token decode right
    after it, at 512 tokens of context."""
    seq = ctx.n_seq_max - 1
    token = ctx.model.tokenize(" the", add_special=False)[0]
    start = calibrate.CONTEXT_TOKENS
    calibrate.fill_context(ctx, seq, token, 0, start)
    out = {}
    try:
        for n in SIZES:
            steady = [1e3 * calibrate.time_batch(ctx, n, seq, token, start, repeats=1) for _ in range(repeats)]
            mixed, back = [], []
            for _ in range(repeats):
                calibrate.time_batch(ctx, 1, seq, token, start, repeats=1)
                mixed.append(1e3 * calibrate.time_batch(ctx, n, seq, token, start, repeats=1))
                back.append(1e3 * calibrate.time_batch(ctx, 1, seq, token, start, repeats=1))
            out[n] = {"steady_ms": steady, "after_one_token_ms": mixed, "one_token_after_ms": back}
    finally:
        ctx.seq_rm(seq, -1, -1)
    return out


def trace(drafter: AutoDrafter, steps: list) -> None:
    """Wraps the drafter's per-step choice so that each step appends what it decided."""
    inner = drafter._choose

    def choose(context, budget):
        t = time.perf_counter()
        choice = inner(context, budget)
        probs = drafter._suffix_path_probs(choice.offered)
        m, _ = best_tree_prefix(probs, drafter.cost, budget)
        steps.append({"offered": len(choice.offered), "m": m, "probs": [round(p, 3) for p in probs[:8]],
                      "floor": choice.floor, "plan_nodes": choice.plan.nodes, "plan_rate": choice.plan.rate,
                      "plan_tree": choice.plan.tree, "chosen": len(choice.chosen), "source": choice.chosen.source,
                      "model_s": choice.model.seconds if choice.model else 0.0,
                      "choose_ms": 1e3 * (time.perf_counter() - t)})
        return choice

    drafter._choose = choose


def summary(steps: list) -> dict:
    n = len(steps) or 1
    return {"steps": len(steps), "sources": dict(Counter(s["source"] for s in steps)),
            "offered_mean": sum(s["offered"] for s in steps) / n,
            "offered_but_plain": sum(1 for s in steps if s["offered"] and not s["chosen"]),
            "model_planned": sum(1 for s in steps if s["plan_nodes"]),
            "model_ms_total": 1e3 * sum(s["model_s"] for s in steps),
            "choose_ms_mean": sum(s["choose_ms"] for s in steps) / n}


def run(config: EngineConfig, prompts, tokens: int) -> dict:
    with Engine(config) as engine:
        d = engine.drafter
        cost = d.cost
        info = {"plan": {"n_gpu_layers": engine.load_plan.model.n_gpu_layers,
                         "shape": [engine.load_plan.shape.draft_max, engine.load_plan.shape.tree]},
                "cost": {"batch_sizes": list(cost.batch_sizes), "verify_ms": [1e3 * s for s in cost.verify_s],
                         "draft_token_ms": 1e3 * cost.draft_token_s},
                "model": getattr(d.model, "name", None) if d.model is not None else None,
                "memory": d.memory.load() if d.memory is not None else None}
        print(json.dumps(info)[:3000], flush=True)
        steps: list = []
        trace(d, steps)
        runs = []
        for p in prompts:
            engine.reset()
            tokens_in = engine.chat_tokens([{"role": "user", "content": p.text}]) if p.templated \
                else engine.text_tokens(p.text)
            before = len(steps)
            done = engine.decoder.generate(tokens_in, GenerationRequest(max_tokens=tokens, sampling=SamplingParams()))
            runs.append({"id": p.id, "tok_per_s": done.stats.generated_tokens / done.stats.gen_s,
                         **summary(steps[before:])})
            print(json.dumps(runs[-1]), flush=True)
        info["runs"] = runs
        info["first_steps"] = steps[:40]
        info["decode_times"] = decode_times(engine.ctx)
        print(json.dumps(info["decode_times"]), flush=True)
        return info


def main() -> None:
    target, out_path = sys.argv[1], sys.argv[2]
    placement = sys.argv[3] if len(sys.argv) > 3 else "gpu"
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    limit = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 256
    prompts = select(load_suite("code-edit-test"), limit, "test")
    config = EngineConfig(model=target, draft="auto", placement=placement, n_threads=threads)
    home = ModelStore().home
    result = {"target": target, "placement": placement, "as_found": run(config, prompts, tokens)}
    # what it learned set aside, then its calibration too, measured with more repeats per size
    shutil.rmtree(home / "policy", ignore_errors=True)
    result["fresh_memory"] = run(config, prompts, tokens)
    shutil.rmtree(home / "policy", ignore_errors=True)
    for f in (home / "calibration").glob("verify-*"):
        f.unlink()
    calibrate.REPEATS = 4
    result["fresh_calibration_4_repeats"] = run(config, prompts, tokens)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
