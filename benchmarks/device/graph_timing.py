"""Where a change of batch shape spends its time in llama.cpp: graph build, scheduler allocation,
and the rest of the decode's host work (inputs, the CUDA graph's launch or capture).

    graph_timing.py patch SRC          time process_ubatch in SRC's llama-context.cpp (a copy
                                       already patched by native/llama_cpp_patches.py)
    graph_timing.py run TARGET.gguf OUT.json [LAYERS]
                                       decode sizes in the order a verifier meets them and
                                       record each decode's timings (EDGESPEC_GRAPH_TIMING=1)

A measurement for the device only (benchmarks/device/run.sh graphtiming): the patch prints one
line per decode to stderr while the variable is set, and nothing otherwise.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

EDITS = [  # (anchor, text put after it) in llama_context::process_ubatch
    ("    auto * gf  = res->get_gf();\n",
     "    const int64_t es_t0 = ggml_time_us(); int64_t es_build = 0, es_alloc = 0; bool es_reused = true;\n"),
    ("        gf = model.build_graph(gparams);\n",
     "        es_build = ggml_time_us() - es_t0; es_reused = false;\n"),
    ("        gf_res_prev_active = res;\n",
     "        es_alloc = ggml_time_us() - es_t0 - es_build;\n"),
    ("    const auto status = graph_compute(res->get_gf(), ubatch.n_tokens > 1);\n",
     '    if (getenv("EDGESPEC_GRAPH_TIMING")) fprintf(stderr, "edgespec-graph n=%d reused=%d build_us=%lld '
     'alloc_us=%lld total_us=%lld\\n", (int) ubatch.n_tokens, (int) es_reused, (long long) es_build, '
     '(long long) es_alloc, (long long) (ggml_time_us() - es_t0));\n'),
]
LINE = re.compile(r"edgespec-graph n=(\d+) reused=(\d) build_us=(\d+) alloc_us=(\d+) total_us=(\d+)")
SIZES = (2, 4, 8, 16, 32)


def patch(src: str) -> None:
    path = Path(src) / "vendor/llama.cpp/src/llama-context.cpp"
    text = path.read_text()
    if "es_t0" in text:
        return
    for anchor, after in EDITS:
        if text.count(anchor) != 1:
            sys.exit(f"graph_timing: anchor not found once in {path}: {anchor.strip()}")
        text = text.replace(anchor, anchor + after)
    path.write_text(text)


def run(target: str, out: str, layers: int = 99) -> None:
    os.environ["EDGESPEC_GRAPH_TIMING"] = "1"
    log = tempfile.NamedTemporaryFile(prefix="graph-timing-", suffix=".log", delete=False)
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)  # llama.cpp's own stderr lines land in the file
    try:
        order = _decode_pattern(target, layers)
    finally:
        os.dup2(saved, 2)
    lines = [m.groups() for m in map(LINE.search, Path(log.name).read_text(errors="replace").splitlines()) if m]
    decodes = [dict(zip(("n", "reused", "build_us", "alloc_us", "total_us"), map(int, g))) for g in lines]
    timed = decodes[-len(order):]  # the pattern's own decodes, after the context fill and warm-up
    rows = [dict(d, after=prev, label=label) for d, (label, prev) in zip(timed, order)]
    json.dump({"target": target, "decodes": rows}, open(out, "w"), indent=1)
    for label in sorted({r["label"] for r in rows}):
        pick = [r for r in rows if r["label"] == label]
        mid = sorted(pick, key=lambda r: r["total_us"])[len(pick) // 2]
        print(label, "reused", sum(r["reused"] for r in pick), "/", len(pick), "median:", mid)


def _decode_pattern(target: str, layers: int) -> list[tuple[str, int]]:
    """Fills 512 tokens of context, warms every size up, then per size: steady decodes of it,
    and it between one-token decodes; returns (label, previous size) per timed decode."""
    from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams
    from edgespec.drafters.auto import calibrate

    model = LlamaModel(target, ModelParams(n_gpu_layers=layers))
    ctx = LlamaContext(model, ContextParams(n_ctx=2048, n_seq_max=1, n_outputs_max=64))
    token, start, order = model.tokenize(" the", add_special=False)[0], 512, []
    try:
        calibrate.fill_context(ctx, 0, token, 0, start)
        for n in (1, *SIZES):
            calibrate.time_batch(ctx, n, 0, token, start, repeats=3)
        prev = 1
        for n in SIZES:
            for _ in range(4):
                calibrate.time_batch(ctx, n, 0, token, start, repeats=1)
                order.append((f"{n:02d} steady", prev))
                prev = n
            for _ in range(4):
                for size, label in ((1, "01 before"), (n, f"{n:02d} after 1"), (1, f"01 after {n:02d}")):
                    calibrate.time_batch(ctx, size, 0, token, start, repeats=1)
                    order.append((label, prev))
                    prev = size
    finally:
        ctx.close()
        model.close()
    return order


if __name__ == "__main__":
    if sys.argv[1] == "patch":
        patch(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
