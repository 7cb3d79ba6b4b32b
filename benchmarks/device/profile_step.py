"""Where one step's time goes: inside llama_decode (kernels, synchronised) vs. everything else.

    profile_step.py TARGET.gguf OUT.json [PLACEMENT [THREADS [TOKENS]]]
        [--draft suffix|auto] [--suite code-edit-test|specbench] [--categories A,B] [--limit N]
        [--temperature T]

For plain decoding and for speculation (suffix by default) on held-out prompts (code edits by
default), with the rows' picks on the GPU and without (greedy: argmax; ``--temperature``: each
row's largest logits), the time per step split into:
llama_decode plus the wait for its kernels (``decode``), reading rows (``rows``: logits copies and
argmax, the picked token ids, or the largest logits), the drafter's ``propose`` (auto's whole choice), its
``observe`` (what a step teaches it), filling the batch (``batch``), keeping the accepted path
in the cache (``commit``), the output's text and stop checks (``output``), and the rest (the
step's Python, acceptance). ``begin_ms_per_request``: the request's start (the suffix index
taking the prompt), beside the prefill; what of it the prefill did not hide is in the rest.
The profile synchronises after each decode so that kernel time lands in
``decode``; without it the wait would hide in the first row read.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from edgespec.bench.prompts import load_suite, prompt_tokens, select
from edgespec.decode.loop import Decoder
from edgespec.decode.output import OutputStream
from edgespec.decode.sequence import KVSequence
from edgespec.llama.batch import Batch
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.llama import backend, rows

TOKENS = 256
PARTS = ("decode", "rows", "propose", "observe", "batch", "commit", "output")
clock = defaultdict(float)
counts = defaultdict(int)


def timed(owner, name: str, key: str, sync=None):
    """Wraps owner.name so that its time adds to clock[key]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            out = inner(*args, **kwargs)
            if sync is not None:
                sync(args[0])
            return out
        finally:
            clock[key] += time.perf_counter() - t
            counts[key] += 1
    setattr(owner, name, wrapper)


SAMPLING = SamplingParams()


def profile(engine: Engine, prompts, draft: bool) -> dict:
    decoder = engine.decoder if draft else Decoder(engine.model, engine.seq)
    clock.clear(), counts.clear()
    total = steps = tokens = prefill = 0.0
    for p in prompts:
        engine.reset()
        tokens_in = prompt_tokens(engine, p)
        done = decoder.generate(tokens_in,
                                GenerationRequest(max_tokens=TOKENS, sampling=SAMPLING))
        total += done.stats.gen_s
        prefill += done.stats.prompt_eval_s  # the prompt's decodes: not a step's
        tokens += done.stats.generated_tokens
        steps += done.stats.spec.steps if done.stats.spec else done.stats.generated_tokens
    decode = clock["decode"] - prefill
    out = {"draft": draft, "greedy_on_backend": engine.ctx.params.greedy_on_backend, "steps": steps, "tokens": tokens,
           "tok_per_s": tokens / total, "ms_per_step": 1e3 * total / steps,
           "decode_ms_per_step": 1e3 * decode / steps, "rows_ms_per_step": 1e3 * clock["rows"] / steps,
           "propose_ms_per_step": 1e3 * clock["propose"] / steps,
           "observe_ms_per_step": 1e3 * clock["observe"] / steps,
           "batch_ms_per_step": 1e3 * clock["batch"] / steps, "commit_ms_per_step": 1e3 * clock["commit"] / steps,
           "output_ms_per_step": 1e3 * clock["output"] / steps,
           "begin_ms_per_request": 1e3 * clock["begin"] / len(prompts)}
    out["other_ms_per_step"] = out["ms_per_step"] - sum(out[f"{k}_ms_per_step"] for k in PARTS)
    return out


def main() -> None:
    global TOKENS, SAMPLING
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("placement", nargs="?", default="gpu")
    ap.add_argument("threads", nargs="?", type=int, default=8)
    ap.add_argument("tokens", nargs="?", type=int, default=TOKENS)
    ap.add_argument("--draft", default="suffix")
    ap.add_argument("--suite", default="code-edit-test")
    ap.add_argument("--categories", default="", help="comma-separated; default every one")
    ap.add_argument("--limit", type=int, default=1, help="prompts per category")
    ap.add_argument("--no-warm", action="store_true", help="only GPU picks on, no warm-up answer")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (seed 0)")
    a = ap.parse_args()
    TOKENS = a.tokens
    SAMPLING = SamplingParams(temperature=a.temperature, seed=0 if a.temperature > 0 else None)
    lc = backend.lc
    timed(backend.lc, "llama_decode", "decode", sync=lc.llama_synchronize)
    for name in ("__call__", "greedy", "top"):
        timed(rows.Rows, name, "rows")
    for name in ("fill", "pad"):
        timed(Batch, name, "batch")
    timed(KVSequence, "_commit", "commit")
    timed(OutputStream, "push_step", "output")
    wanted = set(filter(None, a.categories.split(",")))
    suite = [p for p in load_suite(a.suite) if not wanted or p.category in wanted]
    prompts = select(suite, a.limit, "test")
    warm = select(suite, 1, "validate")[:1]
    results = []
    for on in (True,) if a.no_warm else (True, False):  # a fresh engine each: the suffix index learns
        config = EngineConfig(model=a.target, draft=a.draft, placement=a.placement, n_threads=a.threads,
                              greedy_on_backend=on)
        with Engine(config) as engine:
            timed(engine.drafter, "propose", "propose")
            timed(engine.drafter, "observe", "observe")
            timed(engine.decoder.step, "begin", "begin")
            if not a.no_warm:
                profile(engine, warm, True)  # warm-up: graphs, caches
            for draft in (False, True):
                results.append(profile(engine, prompts, draft))
                print(json.dumps(results[-1]), flush=True)
    one = {r["greedy_on_backend"]: r["decode_ms_per_step"] for r in results if not r["draft"]}
    for r in results:  # host time per step over the target's one-token decode
        r["host_share_of_one_token"] = (r["ms_per_step"] - r["decode_ms_per_step"]) / one[r["greedy_on_backend"]]
    with open(a.out, "w") as f:
        json.dump({"target": a.target, "placement": a.placement, "tokens": TOKENS, "draft": a.draft,
                   "suite": a.suite, "categories": sorted(wanted), "temperature": a.temperature,
                   "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
