"""A real model through llama.cpp: T(n) of an n-token verification batch (every row's logits,
after 512 tokens of context, flash attention off unless --flash-attn), whether each row's logits have the bits of
the same token decoded alone, and optionally a prefill's time a token. Run it against the stock
wheel and against a ggml CPU backend built with llama_cpp_qmatmul.py's patch (LD_LIBRARY_PATH
wins over the wheel's RUNPATH; a directory holding only the patched libggml-cpu.so.0 is enough):

    flock /tmp/edgespec-cpu.lock .venv/bin/python native/qmatmul/e2e_llama.py MODEL [--sizes 1,2,4,8,16] [--no-bits] [--prefill 512] [--flash-attn]
    LD_LIBRARY_PATH=BUILD/src flock /tmp/edgespec-cpu.lock .venv/bin/python native/qmatmul/e2e_llama.py MODEL ...
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from edgespec.drafters.auto.calibrate import measure_verify  # noqa: E402
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64)
TEXT = ("def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"
        "    left = [x for x in items[1:] if x < pivot]\n    right = [x for x in items[1:] if x >= pivot]\n"
        "    return quicksort(left) + [pivot] + quicksort(right)\n\n# The same sort, iterative, with an explicit"
        " stack of ranges so that deep recursion cannot overflow on sorted input, and a few tests.\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-bits", action="store_true")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="batch sizes to time, e.g. 1,2,4,8,16")
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many tokens, one micro-batch")
    ap.add_argument("--flash-attn", action="store_true", help="flash attention on (qattn where patched in), as edgespec runs a CPU target")
    args = ap.parse_args()
    model = LlamaModel(args.model, ModelParams(repack=not args.no_repack))
    if args.prefill:
        prefill(model, args.prefill)
    ctx = LlamaContext(model, ContextParams(n_ctx=1024, n_batch=64, n_ubatch=64, n_seq_max=2, n_threads=2,
                                            n_threads_batch=2, flash_attn=args.flash_attn))
    print(f"model {Path(args.model).name}, repack {'off' if args.no_repack else 'on'}, "
          f"flash attention {'on' if args.flash_attn else 'off'}")
    if not args.no_bits:
        bits(model, ctx)
    if not args.no_timing:
        sizes, times = measure_verify(ctx, tuple(int(n) for n in args.sizes.split(",")))
        print("  T(n) ms:     " + "  ".join(f"{n}: {t * 1e3:.1f}" for n, t in zip(sizes, times)))
        print("  T(n)/T(1):   " + "  ".join(f"{n}: {t / times[0]:.2f}" for n, t in zip(sizes, times)))
    return 0


def prefill(model: LlamaModel, n: int) -> None:
    """Milliseconds per token of an n-token prompt decoded in one micro-batch (the fastest of 3)."""
    ctx = LlamaContext(model, ContextParams(n_ctx=2 * n, n_batch=n, n_ubatch=n, n_seq_max=1, n_threads=2,
                                            n_threads_batch=2, flash_attn=False))
    tokens = (model.tokenize(TEXT, add_special=False) * (n // 64 + 1))[:n]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        ctx.decode(tokens, range(n), [[0]] * n, [False] * (n - 1) + [True])
        best = min(best, time.perf_counter() - t0)
        ctx.seq_rm(0, -1, -1)
    print(f"  prefill of {n} tokens: {best * 1e3 / n:.2f} ms a token")


def bits(model: LlamaModel, ctx: LlamaContext) -> None:
    """Whether each row of batches of 2..64 has the bits of the same token decoded alone."""
    tokens = model.tokenize(TEXT, add_special=False)
    prefix, draft = tokens[:32], tokens[32:96]
    assert len(draft) == 64, len(tokens)
    ctx.decode(prefix, range(32), [[0]] * 32, [False] * 31 + [True])
    alone = np.stack([ctx.decode([t], [32 + k], [[0]], [True])[0] for k, t in enumerate(draft)])
    for n in SIZES[1:]:
        ctx.seq_rm(0, 32, -1)
        rows = ctx.decode(draft[:n], range(32, 32 + n), [[0]] * n, [True] * n)
        same = sum(np.array_equal(rows[k].view(np.uint32), alone[k].view(np.uint32)) for k in range(n))
        print(f"  batch of {n:2d}: {same:2d} of {n:2d} rows have the one-token decode's bits, "
              f"max |logit difference| {np.max(np.abs(rows - alone[:n])):.3g}")
    ctx.seq_rm(0, -1, -1)


if __name__ == "__main__":
    sys.exit(main())
