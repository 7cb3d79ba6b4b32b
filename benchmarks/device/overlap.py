"""Overlap on the GPU machine: does drafting on one processor hide behind verification on another?

    overlap.py MODELS_DIR OUT.json

Per placement (7B-shaped target clone, 0.5B-shaped drafter clone, 8 CPU threads), on the
contexts the engine builds for it and after a 512-token prompt, the fastest of five runs of:

* ``verify``: the target verifying pending + a k-token chain (KVSequence.verifying, rolled back);
* ``ahead``: what overlap drafts beside it: the drafter's guess and a k-token chain after it;
* ``both``: the two at once, the verification in a worker thread (edgespec.decode.sequence.run_beside).

``both`` close to max(verify, ahead) means the drafting hides; close to the sum, it does not.
Then the engine end to end, `draft-gpu` against `overlap`, one 64-token greedy answer each with
chains of 8 drafted every step: clones accept nothing, so no draft ahead is ever used and the
ratio is what overlap costs where it cannot pay.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import edgespec  # noqa: F401  (first: llama.cpp must load before numpy here, edgespec/llama/__init__.py)
import numpy as np

from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.decode.tree import DraftTree

log = logging.getLogger("overlap")
GiB = 1 << 30
PROMPT_TOKENS = 512
CHAINS = (4, 8, 16, 32)
REPEATS = 5
# name: (placement, VRAM budget); offload: a third of the 7B clone's weights, as engine_modes.py
PLACEMENTS = {
    "draft-gpu-7b": ("draft-gpu", None),
    "offload-7b": ("offload", int(4.36 * GiB / 3) + 256 * (1 << 20)),
    "gpu-7b": ("gpu", None),
}


def _fastest(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _micro(engine: Engine, rng: np.random.Generator) -> dict:
    seq, drafter = engine.seq, engine.drafter
    drafter.min_confidence = 0.0  # random weights are never confident: draft every token
    prompt = rng.integers(100, 20000, PROMPT_TOKENS).tolist()
    seq.sync(prompt)
    out = {}
    for k in CHAINS:
        draft = DraftTree.chain(rng.integers(100, 20000, k).tolist(), "model")
        context = prompt + draft.tokens.tolist()

        def verify():
            with seq.verifying(prompt[-1], draft) as v:
                v.commit([])
            seq.trim(len(prompt) - 1)  # keep the cache at the prompt minus pending

        def ahead():
            guess = drafter.guess(context)
            drafter.propose(context + [guess], k)

        def both():
            with seq.verifying(prompt[-1], draft, ahead) as v:
                v.commit([])
            seq.trim(len(prompt) - 1)

        seq.trim(len(prompt) - 1)
        r = {"verify_s": _fastest(verify), "ahead_s": _fastest(ahead), "both_s": _fastest(both)}
        r["hidden"] = (r["verify_s"] + r["ahead_s"] - r["both_s"]) / min(r["verify_s"], r["ahead_s"])
        out[str(k)] = r
        log.info("k=%d %s", k, json.dumps(r))
    return out


def _answer(engine: Engine) -> dict:
    engine.drafter.min_confidence = 0.0
    req = GenerationRequest(max_tokens=64, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    engine.chat([{"role": "user", "content": "Hi"}], GenerationRequest(max_tokens=4))  # warm-up
    engine.reset()
    done = engine.chat([{"role": "user", "content": "Write a Python function that merges two sorted lists."}], req)
    return {"tok_s": done.stats.tokens_per_s, "spec": done.stats.spec.to_dict(), "tokens": list(done.token_ids)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    models, dest = Path(sys.argv[1]), Path(sys.argv[2])
    results: dict = {}
    base = dict(model=str(models / "qwen7b.gguf"), n_ctx=2048, n_threads=8, draft="model",
                draft_model=str(models / "qwen0.5b.gguf"), draft_max=32)
    for name, (mode, vram) in PLACEMENTS.items():
        try:
            with Engine(EngineConfig(**base, placement=mode, vram_budget=vram, overlap=True)) as engine:
                plan = engine.load_plan.plan
                results[name] = {"n_gpu_layers": plan.n_gpu_layers, "drafter": plan.drafter_placement,
                                 "chains": _micro(engine, np.random.default_rng(0))}
        except Exception as exc:  # one placement's failure must not hide the others
            log.exception("%s failed", name)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        dest.write_text(json.dumps(results, indent=1))
    e2e = {}
    for mode in ("draft-gpu", "overlap"):
        cfg = EngineConfig(**dict(base, draft_max=8), placement=mode)
        with Engine(cfg) as engine:
            e2e[mode] = _answer(engine)
    e2e["same_answer"] = e2e["draft-gpu"]["tokens"] == e2e["overlap"]["tokens"]
    e2e["overlap_over_draft_gpu"] = e2e["overlap"]["tok_s"] / e2e["draft-gpu"]["tok_s"]
    results["e2e-7b"] = e2e
    dest.write_text(json.dumps(results, indent=1))
    log.info("e2e: %s", json.dumps({k: (v if not isinstance(v, dict) else v["tok_s"]) for k, v in e2e.items()}))


if __name__ == "__main__":
    main()
