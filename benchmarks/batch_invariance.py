"""Which llama.cpp CPU settings compute a batch's rows bit for bit as one-token decodes, and what
the batch-invariant ones cost (edgespec.llama.invariant, `--exact`).

For each setting, in a process of its own (llama.cpp reads GGML_CPU_TILED_MM once per process):
decode a real text's first L tokens, then its next 64 tokens in batches of n (n = 1: one at a
time) with every row's logits, and report the largest |logit| difference of each n against
n = 1; for the settings in TIMED, the cost of an n-token batch after 512 and 1024 tokens of
context (min of 3, as edgespec.drafters.auto.calibrate times it).

    flock /tmp/edgespec-bench.lock .venv/bin/python benchmarks/batch_invariance.py \
        --json benchmarks/results/batch-invariance.json --markdown benchmarks/results/batch-invariance.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "edgespec" / "decode" / "sequence.py"
CONTEXTS = (150, 1000)
BATCHES = (2, 4, 8, 16, 64)
TIMED_SIZES = (1, 2, 4, 8, 16, 32, 64)
TIMED_DEPTHS = (512, 1024)
# name: (repack, flash attention, KV cache type, tiled matmul)
SETTINGS = {
    "default (repacked, no flash attention)": (True, False, "f16", True),
    "repacked, flash attention, f16 cache (--flash-attn)": (True, True, "f16", True),
    "no repacking, flash attention, f16 cache": (False, True, "f16", True),
    "no repacking, flash attention, q8_0 cache": (False, True, "q8_0", True),
    "repacked, flash attention, q8_0 cache, tiled off": (True, True, "q8_0", False),
    "exact: no repacking, flash attention, q8_0 cache, tiled off": (False, True, "q8_0", False),
}
TIMED = ("default (repacked, no flash attention)", "repacked, flash attention, f16 cache (--flash-attn)",
         "exact: no repacking, flash attention, q8_0 cache, tiled off")


def child(repack: bool, fa: bool, kv: str, timed: bool, model: str) -> dict:
    # llama.cpp before numpy: on the GPU machine a process that loaded numpy first died at its
    # first model load (benchmarks/RESULTS-gpu.md section 4)
    from edgespec.drafters.auto.calibrate import fill_context, time_batch  # noqa: I001
    from edgespec.files.store import ModelStore
    from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams

    import numpy as np

    # CPU kernels only: in a CUDA build, weights outside pinned host buffers (no_host) so that
    # repacking happens, and no op offload (batches of 32+ would multiply on the GPU)
    m = LlamaModel(ModelStore().resolve(model), ModelParams(repack=repack, no_host=repack))
    ctx = LlamaContext(m, ContextParams(n_ctx=2048, flash_attn=fa, kv_type=kv, op_offload=False))
    text = m.tokenize(SOURCE.read_text())
    out = {"deviation": {}, "cost_ms": {}, "threads": ctx.n_threads}
    try:
        for length in CONTEXTS:
            head, rows = text[:length], text[length:length + 64]
            for s in range(0, length, 256):
                chunk = head[s:s + 256]
                ctx.decode(chunk, range(s, s + len(chunk)), [[0]] * len(chunk), [False] * len(chunk))
            logits = {}
            for n in (1, *BATCHES):
                ctx.seq_rm(0, length, -1)
                parts = [ctx.decode(rows[s:s + n], range(length + s, length + s + len(rows[s:s + n])),
                                    [[0]] * len(rows[s:s + n]), [True] * len(rows[s:s + n]))
                         for s in range(0, len(rows), n)]
                logits[n] = np.concatenate(parts)
            out["deviation"][length] = {n: float(np.abs(logits[n] - logits[1]).max()) for n in BATCHES}
            ctx.seq_rm(0, -1, -1)
        if timed:
            token = m.tokenize(" the", add_special=False)[0]
            filled = 0
            for depth in TIMED_DEPTHS:
                fill_context(ctx, 0, token, filled, depth)
                filled = depth
                time_batch(ctx, 1, 0, token, depth)  # warm-up
                out["cost_ms"][depth] = {n: 1e3 * time_batch(ctx, n, 0, token, depth, repeats=3, reduce=min)
                                         for n in TIMED_SIZES}
    finally:
        ctx.close()
        m.close()
    return out


def run_all(model: str, only: str | None = None) -> dict:
    results = {}
    for name, (repack, fa, kv, tiled) in SETTINGS.items():
        if only is not None and only not in name:
            continue
        env = dict(os.environ, GGML_CPU_TILED_MM="1" if tiled else "0")
        args = [sys.executable, __file__, "--child", json.dumps([repack, fa, kv, name in TIMED, model])]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, results[name], file=sys.stderr)
    return results


def markdown(results: dict, command: str) -> str:
    lines = [f"`{command}`", "",
             "Largest |logit| difference, rows of n-token batches against one-token decodes, after L tokens:", "",
             "| setting | " + " | ".join(f"L={length} n={n}" for length in CONTEXTS for n in BATCHES) + " |",
             "|---|" + "---|" * (len(CONTEXTS) * len(BATCHES))]
    for name, r in results.items():
        cells = [f"{r['deviation'][str(length)][str(n)]:.3f}" for length in CONTEXTS for n in BATCHES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    timed = [t for t in TIMED if t in results]
    if timed:
        lines += ["", "ms for an n-token batch after L tokens of context (min of 3):", "",
                  "| setting | L | " + " | ".join(f"n={n}" for n in TIMED_SIZES) + " |",
                  "|---|---|" + "---|" * len(TIMED_SIZES)]
    for name in timed:
        for depth in TIMED_DEPTHS:
            cost = results[name]["cost_ms"][str(depth)]
            lines.append(f"| {name} | {depth} | " + " | ".join(f"{cost[str(n)]:.1f}" for n in TIMED_SIZES) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--only", help="run only the settings whose name contains this (write to files of "
                                   "their own: --json/--markdown are replaced, not merged)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*json.loads(a.child))))
        return
    if a.only is not None and not any(a.only in name for name in SETTINGS):
        ap.error(f"--only {a.only!r} matches no setting: {', '.join(SETTINGS)}")
    results = json.loads(json.dumps(run_all(a.model, a.only)))  # str keys, as read back
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    text = markdown(results, "python " + " ".join(sys.argv))
    if a.markdown:
        a.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
