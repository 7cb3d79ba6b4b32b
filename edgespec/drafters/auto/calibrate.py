"""Measures what a speculative step costs on this machine, once, and caches it.

Target verify time as a function of tokens in one batch, and a model drafter's time per
drafted token, measured on the real contexts and cached in the model store per
(model file, device, threads) so later runs start instantly.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from edgespec.llama.backend import LlamaContext
from edgespec.drafters.auto.policy import CostModel

log = logging.getLogger(__name__)

# Batch sizes timed. CPU matrix kernels work in tiles, so the cost is not smooth in n: on a
# 2-core AVX-512 VM a 16-token batch took 281 ms and a 15-token one 335 ms. The sizes around
# each multiple of 16 are measured so the policy sees those steps and drafts to fill a tile.
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64)
REPEATS = 2
# Verification attends to the whole context: time batches after this many tokens of it, not at
# position 0 (at 900 tokens of context a 17-token batch cost 385 ms against 315 ms at 0).
CONTEXT_TOKENS = 512
VERSION = "v2"  # bump when what is measured changes: older cached calibrations are ignored


def _cache_key(ctx: LlamaContext, tag: str = "") -> str:
    st = os.stat(ctx.model.path)
    p = ctx.model.params
    mode = f"ngl{p.n_gpu_layers}-{'mmap' if p.use_mmap else 'load'}-{'repack' if p.repack else 'norepack'}"
    attn = {None: "fa-auto", True: "fa", False: "nofa"}[ctx.params.flash_attn]
    return (f"{Path(ctx.model.path).name}-{st.st_size}-{st.st_mtime_ns}-t{ctx.n_threads}-{mode}"
            f"-{attn}-{VERSION}{tag}")


def time_batch(ctx: LlamaContext, n: int, seq: int, token: int, start: int = 0, repeats: int = REPEATS,
               reduce=min) -> float:
    """Seconds of an n-token batch at positions start..start+n-1 of a scratch sequence, every
    row's logits requested (as verification asks), rolled back after each run.

    By default the minimum of a few runs: other load on a shared machine only ever adds time,
    and the policy needs the cost of the work itself.
    """
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctx.decode([token] * n, range(start, start + n), [[seq]] * n, [True] * n)
        times.append(time.perf_counter() - t0)
        ctx.seq_rm(seq, start, -1)
    return reduce(times)


def fill_context(ctx: LlamaContext, seq: int, token: int, start: int, end: int) -> None:
    """Decodes filler tokens at positions start..end-1 of ``seq`` (in n_batch chunks), so that
    timed batches attend to a context of ``end`` tokens."""
    for pos in range(start, end, ctx.n_batch):
        n = min(ctx.n_batch, end - pos)
        ctx.decode([token] * n, range(pos, pos + n), [[seq]] * n, [False] * (n - 1) + [True])


def measure_verify(ctx: LlamaContext, sizes=BATCH_SIZES) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Target time per batch size; uses the last sequence id, which must be empty."""
    seq = ctx.n_seq_max - 1
    token = ctx.model.tokenize(" the", add_special=False)[0]
    sizes = tuple(n for n in sizes if n <= ctx.n_batch)
    start = max(0, min(CONTEXT_TOKENS, ctx.n_ctx - 2 * max(sizes, default=1)))
    try:
        fill_context(ctx, seq, token, 0, start)
        time_batch(ctx, 1, seq, token, start)  # warm-up: the first decode faults pages in
        return sizes, tuple(time_batch(ctx, n, seq, token, start) for n in sizes)
    finally:
        ctx.seq_rm(seq, -1, -1)


def measure_draft_token(ctx: LlamaContext) -> float:
    """Seconds per drafted token of a model drafter (one-token decodes)."""
    token = ctx.model.tokenize(" the", add_special=False)[0]
    seq = ctx.n_seq_max - 1
    time_batch(ctx, 1, seq, token)
    return time_batch(ctx, 1, seq, token)


def cost_model(target: LlamaContext, drafter: LlamaContext | None, home: Path, tag: str = "") -> CostModel:
    """The calibrated cost model, from the cache when this configuration was measured before.

    ``tag`` distinguishes placements the parameters do not show (file-backed weights).
    """
    key = _cache_key(target, tag) + (f"+{_cache_key(drafter)}" if drafter is not None else "")
    path = home / "calibration" / f"{key}.json"
    try:
        d = json.loads(path.read_text())
        return CostModel(tuple(d["batch_sizes"]), tuple(d["verify_s"]), d["draft_token_s"])
    except (OSError, ValueError, KeyError):
        pass
    log.info("calibrating speculation costs for %s (once)", Path(target.model.path).name)
    sizes, times = measure_verify(target)
    draft_s = measure_draft_token(drafter) if drafter is not None else 0.0
    cm = CostModel(sizes, times, draft_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"batch_sizes": sizes, "verify_s": times, "draft_token_s": draft_s}))
    os.replace(tmp, path)
    return cm
