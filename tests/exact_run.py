"""Greedy answers of an exact-mode target (edgespec.llama.invariant), without and with drafters,
as JSON on stdout. Run in a process of its own by tests/test_exact.py: llama.cpp reads the tiled
matmul switch once per process, at its first matrix multiplication.

    python tests/exact_run.py answers PROMPTS_JSON MAX_TOKENS CONFIG...   (bench configurations)
    python tests/exact_run.py late     (a default load decodes first: exact mode must refuse)
    python tests/exact_run.py placement MODE TARGET DRAFTER PROMPTS_JSON MAX_TOKENS
                                       (one engine of that placement, plain then speculative)
"""
from __future__ import annotations

import json
import sys

from edgespec.bench.prompts import BenchPrompt
from edgespec.bench.runner import BenchSettings, run_bench
from edgespec.engine import Engine, EngineConfig
from edgespec.llama.invariant import NotBatchInvariant

TARGET = "qwen2.5-coder-1.5b"


def answers(configs: list[str], prompts: list[str], max_tokens: int) -> dict:
    """Each configuration's greedy answers on one exact engine, as `edgespec bench --exact
    --share-prefill` runs them: every prompt evaluated once, plain first."""
    settings = BenchSettings(EngineConfig(model=TARGET, n_ctx=2048, exact=True), max_tokens=max_tokens,
                             share_prefill=True)
    bench = [BenchPrompt(str(i), "exact", p, True) for i, p in enumerate(prompts)]
    out: dict[str, list[dict]] = {}
    for r in run_bench(bench, configs, settings).records:
        out.setdefault(r.config, []).append({"text": r.text, "tokens": r.new_tokens, "steps": r.steps,
                                             "drafted": r.drafted, "accepted": r.accepted})
    return out


def late() -> dict:
    with Engine(EngineConfig(model=TARGET, n_ctx=512)) as engine:  # default kernels, tiled matmul on
        engine.generate("def add(a, b):\n    return a + b\n\ndef sub(a, b):", max_tokens=2, temperature=0.0)
    try:
        Engine(EngineConfig(model=TARGET, n_ctx=512, exact=True)).close()
    except NotBatchInvariant as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def placement(mode: str, target: str, drafter: str, prompts: list[str], max_tokens: int) -> dict:
    """Plain decoding, then 8-token model chains drafted at every step whatever their confidence,
    on one exact engine of ``mode`` (draft-gpu, overlap: a GPU drafter beside a CPU target)."""
    from edgespec.decode.loop import Decoder
    from edgespec.decode.request import GenerationRequest
    from edgespec.decode.sampling import SamplingParams

    cfg = EngineConfig(model=target, n_ctx=1024, placement=mode, n_threads=8, draft="model",
                       draft_model=drafter, draft_max=8, exact=True)
    req = GenerationRequest(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    out = {"plain": [], "spec": [], "drafted": 0}
    with Engine(cfg) as engine:
        engine.drafter.min_confidence = 0.0
        for decoder, key in ((Decoder(engine.model, engine.seq), "plain"), (engine.decoder, "spec")):
            for p in prompts:
                engine.reset()
                done = list(decoder.stream(engine.chat_tokens([{"role": "user", "content": p}]), req))[-1]
                out[key].append(list(done.token_ids))
                out["drafted"] += done.stats.spec.drafted if done.stats.spec else 0
        out["drafter_on_gpu"] = engine.load_plan.plan.drafter_placement == "gpu"
    return out


def main() -> None:
    if sys.argv[1] == "late":
        result = late()
    elif sys.argv[1] == "placement":
        result = placement(*sys.argv[2:5], json.loads(sys.argv[5]), int(sys.argv[6]))
    else:
        prompts, max_tokens = json.loads(sys.argv[2]), int(sys.argv[3])
        result = answers(sys.argv[4:], prompts, max_tokens)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
