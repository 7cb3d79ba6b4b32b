"""What a best-first model-tree step really costs on the GPU machine, against the replay's booking.

    tree_steps.py MODELS_DIR OUT.json

1. The search's own costs with the 0.5B clone on the GPU: one round = ``PathKV.decode`` of k
   tree nodes + ``top_children`` of each row (log-softmax over the vocabulary, in Python), for
   k = 1, 4, 16, 32, timed apart, and a deep chain-shaped search (64 one-node rounds).
2. The engine end to end with ``--draft model --draft-tree`` in the `offload` (7B clone, a third
   of its weights on the GPU, drafter beside it) and `gpu` placements: per step, the tree size,
   rounds and expansions of its search and the step's wall time. The replay books a step as
   verify(size + 1) + its rounds on the drafter's batch curve; set against these, the difference
   is the Python the replay does not book. Clones accept nothing, so their trees are wide and
   shallow (few rounds): part 1 prices the deep trees real text gives.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import edgespec  # noqa: F401  (llama.cpp before numpy: edgespec/llama/__init__.py)
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.drafters.tree_kv import PathKV
from edgespec.engine import Engine, EngineConfig
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams
from edgespec.spec.tree_search import top_children

log = logging.getLogger("tree_steps")
GiB = 1 << 30
PROMPT = "Write a Python function that merges two sorted lists, with tests."
TOKENS = 48
RUNS = {  # name: placement, target clone, VRAM budget (None: free VRAM), draft_max
    "offload-7b": ("offload", "qwen7b", int(4.36 * GiB / 3) + 256 * (1 << 20), 63),
    "gpu-7b": ("gpu", "qwen7b", None, 63),
    "draft-gpu-7b": ("draft-gpu", "qwen7b", None, 15),
}


def search_costs(models: Path) -> dict:
    model = LlamaModel(str(models / "qwen0.5b.gguf"), ModelParams(n_gpu_layers=99))
    ctx = LlamaContext(model, ContextParams(n_ctx=2048, n_batch=512, n_ubatch=64, n_seq_max=256))
    context = list(range(1000, 1512))
    ctx.decode(context, range(len(context)), [[0]] * len(context), [False] * 511 + [True])
    out = {}
    for k in (1, 4, 16, 32):
        times, picks = [], []
        for rep in range(6):
            kv = PathKV(ctx)
            nodes = [(len(context), (2000 + rep * 100 + i,)) for i in range(k)]
            t0 = time.perf_counter()
            rows = kv.decode(nodes)
            t1 = time.perf_counter()
            for row in rows:
                top_children(row, 8)
            t2 = time.perf_counter()
            kv.release()
            times.append(t1 - t0)
            picks.append(t2 - t1)
        out[f"round-{k}"] = {"decode_ms": 1e3 * min(times[1:]), "top_children_ms": 1e3 * min(picks[1:])}
    kv = PathKV(ctx)
    path: tuple[int, ...] = ()
    t0 = time.perf_counter()
    for i in range(64):
        path = path + (3000 + i,)
        top_children(kv.decode([(len(context), path)])[0], 8)
    out["deep-64-rounds_ms"] = 1e3 * (time.perf_counter() - t0)
    kv.release()
    ctx.close()
    model.close()
    return out


def engine_steps(name: str, models: Path) -> dict:
    mode, target, vram, draft_max = RUNS[name]
    cfg = EngineConfig(model=str(models / f"{target}.gguf"), n_ctx=2048, n_threads=8, placement=mode,
                       vram_budget=vram, draft="model", draft_model=str(models / "qwen0.5b.gguf"),
                       draft_max=draft_max, draft_tree=True)
    steps = []
    with Engine(cfg) as engine:
        drafter = engine.drafter
        inner = drafter._tree

        def timed(context, logits, budget):
            t0 = time.perf_counter()
            tree = inner(context, logits, budget)
            s = drafter.last_search
            steps.append({"size": len(tree), "rounds": s.rounds, "expansions": s.expansions,
                          "search_ms": 1e3 * (time.perf_counter() - t0)})
            return tree

        drafter._tree = timed
        req = GenerationRequest(max_tokens=TOKENS, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
        engine.chat([{"role": "user", "content": "Hi"}], GenerationRequest(max_tokens=4))
        engine.reset()
        steps.clear()
        t0 = time.perf_counter()
        done = engine.chat([{"role": "user", "content": PROMPT}], req)
        wall = time.perf_counter() - t0
        plan = engine.load_plan.plan
    spec = done.stats.spec
    return {"placement": plan.placement, "n_gpu_layers": plan.n_gpu_layers, "draft_max": draft_max,
            "decode_tok_s": done.stats.tokens_per_s, "gen_s": done.stats.gen_s, "wall_s": wall,
            "spec": spec.to_dict() if spec else None, "steps": steps}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    models, dest = Path(sys.argv[1]), Path(sys.argv[2])
    results = {}
    for name, fn in [("search", lambda: search_costs(models))] + [
            (n, lambda n=n: engine_steps(n, models)) for n in RUNS]:
        try:
            results[name] = fn()
        except Exception as exc:  # one part's failure must not hide the others' results
            log.exception("%s failed", name)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        dest.write_text(json.dumps(results, indent=1))
        log.info("%s: %s", name, json.dumps(results[name])[:600])


if __name__ == "__main__":
    main()
