"""edgespec's engine end to end in each placement mode on the shape clones (GPU machine).

    engine_modes.py MODELS_DIR OUT.json [MODE ...]

Per mode: the plan (placement, GPU layers, planned VRAM) against llama.cpp's own report of its
CUDA buffers, then plain decoding and speculation (model drafter, chains of 8) of the same
prompt in the same placement, with tokens/s, drafted/accepted and whether the greedy answers
agree. Clones accept (almost) nothing, so these speeds are the cost of speculating without
acceptance, not speedups; speedups come from replaying real acceptance against measured costs
(benchmarks/replay/replay.py).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.llama.probe import capture_llama_log, reported_buffers
from edgespec.memory.candidates import GPU_RUNTIME_BYTES

log = logging.getLogger("engine_modes")
GiB = 1 << 30
PROMPT = "Write a Python function that merges two sorted lists, with tests."
TOKENS = 64
# mode: target clone, VRAM budget (None: free VRAM minus a margin)
RUNS = {
    "gpu-1.5b": ("gpu", "qwen1.5b", None),
    "gpu-7b": ("gpu", "qwen7b", None),
    # a third of the 7B clone's 4.36 GiB of weights, the drafter included
    "offload-7b": ("offload", "qwen7b", int(4.36 * GiB / 3) + 256 * (1 << 20)),
    "draft-gpu-7b": ("draft-gpu", "qwen7b", None),
    "cpu-1.5b": ("cpu", "qwen1.5b", None),
}


def _device_buffers(lines) -> dict[str, int]:
    return {k: v for k, v in reported_buffers(lines).items()
            if k.startswith("CUDA") and not k.startswith("CUDA_Host")}


def _generate(engine: Engine) -> dict:
    req = GenerationRequest(max_tokens=TOKENS, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    engine.reset()
    engine.chat([{"role": "user", "content": "Hi"}], GenerationRequest(max_tokens=4))  # warm-up
    engine.reset()
    t0 = time.perf_counter()
    done = engine.chat([{"role": "user", "content": PROMPT}], req)
    wall = time.perf_counter() - t0
    s = done.stats
    return {"tokens": list(done.token_ids), "decode_tok_s": s.tokens_per_s,
            "wall_s": wall, "spec": s.spec.to_dict() if s.spec else None}


def run(name: str, models: Path) -> dict:
    mode, target, vram = RUNS[name]
    base = dict(model=str(models / f"{target}.gguf"), n_ctx=2048, n_threads=8, placement=mode,
                vram_budget=vram)
    out: dict = {"mode": mode, "target": target, "vram_budget": vram}
    with capture_llama_log() as cap:
        with Engine(EngineConfig(**base)) as engine:
            plan = engine.load_plan.plan
            out["plan"] = {"placement": plan.placement, "n_gpu_layers": plan.n_gpu_layers,
                           "vram_planned": plan.vram_bytes, "ram_planned": plan.ram_bytes,
                           "no_host": plan.no_host, "op_offload": plan.op_offload}
            out["plain"] = _generate(engine)
    out["plain_cuda_buffers"] = _device_buffers(cap.lines)
    cfg = EngineConfig(**base, draft="model", draft_model=str(models / "qwen0.5b.gguf"), draft_max=8)
    with capture_llama_log() as cap:
        with Engine(cfg) as engine:
            plan = engine.load_plan.plan
            # Random weights are never confident: draft full chains anyway, so the step pays
            # for drafting 8 tokens and verifying 9 (the cost of speculating with no acceptance).
            engine.drafter.min_confidence = 0.0
            out["spec_plan"] = {"placement": plan.placement, "n_gpu_layers": plan.n_gpu_layers,
                                "drafter": plan.drafter_placement, "vram_planned": plan.vram_bytes}
            out["spec"] = _generate(engine)
    buffers = _device_buffers(cap.lines)
    out["spec_cuda_buffers"] = buffers
    reported = sum(buffers.values())
    # A plan with nothing on the GPU counts no runtime there either
    planned = max(plan.vram_bytes - GPU_RUNTIME_BYTES, 0)
    out["vram_check"] = {"planned_buffers": planned, "reported": reported,
                         "ratio": planned / reported if reported else None}
    out["same_answer"] = out["plain"]["tokens"] == out["spec"]["tokens"]
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    models, dest = Path(sys.argv[1]), Path(sys.argv[2])
    names = sys.argv[3:] or list(RUNS)
    results = json.loads(dest.read_text()) if dest.exists() else {}
    for name in names:
        try:
            results[name] = run(name, models)
        except Exception as exc:  # one mode's failure must not hide the others' results
            log.exception("%s failed", name)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        dest.write_text(json.dumps(results, indent=1))
        r = results[name]
        log.info("%s: %s", name, json.dumps({k: r.get(k) for k in ("plan", "vram_check", "same_answer", "error")}))


if __name__ == "__main__":
    main()
