"""Measures what a speculative step costs on this machine, once, and caches it.

Target verify time as a function of tokens in one batch, and a drafter's time per drafted
token, measured on the real contexts and cached in the model store apart: the verify curve per
(target file, placement, threads, attention kernel), the drafted-token cost per drafter
configuration (a llama.cpp drafter's file and placement, or an ONNX conversion and its
provider). Keys are computed from the load settings alone (``calibration_key``), so whether a
drafter pays is known before it is loaded: `auto` then never loads one that cannot.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from edgespec.decode.sampling import greedy_logprob
from edgespec.files.store_files import write_or_keep
from edgespec.llama import invariant
from edgespec.llama.backend import LlamaContext, ModelParams, qmatmul_build, qmatmul_loaded, system_info
from edgespec.drafters.auto.policy import CostModel
from edgespec.llama.kernels import cuda_graphs, op_offload_min_batch
from edgespec.llama.rows import OUTPUT_ARGMAX

log = logging.getLogger(__name__)

# Batch sizes timed. CPU matrix kernels work in tiles, so the cost is not smooth in n: on a
# 2-core AVX-512 VM a 16-token batch took 281 ms and a 15-token one 335 ms. The sizes around
# each multiple of 16 are measured so the policy sees those steps and drafts to fill a tile.
BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64)

REPEATS = 2
# On a GPU the first two decodes of a batch size each cost ~10 ms on an H200 with the 1.5B (its
# graph built and captured), so there each size is first decoded WARMUPS times untimed. There a
# decode of another shape than the last one rebuilds llama.cpp's graph (2 tokens: 3.1 ms after a
# one-token decode against 2.15 ms after another 2-token one), and so does the plain step after a
# verification: a verification of n > 1 tokens is priced as the round trip, timed after a
# one-token decode with the one-token decode that follows it, less one one-token decode.
WARMUPS = 2
# Verification attends to the whole context: time batches after this many tokens of it, not at
# position 0 (at 900 tokens of context a 17-token batch cost 385 ms against 315 ms at 0).
CONTEXT_TOKENS = 512
VERSION = "v6"  # bump when what is measured changes: older cached calibrations are ignored
# ... and this when only the drafted token's measure changes (since "pick": its greedy pick counted)
DRAFT_VERSION = "pick"


def sizes_up_to(largest: int | None) -> tuple[int, ...]:
    """The batch sizes a configuration whose steps verify at most ``largest`` tokens needs timed:
    BATCH_SIZES up to it, and ``largest`` itself (None: all of them). Sizes 48-64 are ~45% of
    a full calibration's time, and the default ``--draft-max 32`` never asks for them."""
    if largest is None:
        return BATCH_SIZES
    return tuple(sorted({n for n in BATCH_SIZES if n <= largest} | {max(1, largest)}))


def calibration_key(path: str | os.PathLike, params: ModelParams, n_threads: int, flash_attn: bool | None,
                    tag: str = "", graph_sizes: tuple[int, ...] = ()) -> str:
    """The cache key of a llama.cpp load: its file, placement, threads and kernels, and the batch
    sizes its context keeps graphs for (ContextParams.graph_sizes: batches padded to them)."""
    st = os.stat(path)
    mode = f"ngl{params.n_gpu_layers}-{'mmap' if params.use_mmap else 'load'}-{'repack' if params.repack else 'norepack'}"
    if qmatmul_loaded():  # edgespec's CPU matmul: 2 rows cost 1.2x one, against 1.7x stock
        mode += "-qmm" + qmatmul_build()
    if not invariant.tiled_matmul_requested():  # exact mode's 16-row batches cost 2.1x the default's
        mode += "-notiled"
    # Which batches copy CPU-resident weights to the GPU: every context of a model with GPU
    # layers runs op offload (placements.target_flags; a drafter's likewise), none without.
    if params.n_gpu_layers != 0:  # "w": sizes warmed up and timed after a one-token decode
        mode += f"-ob{op_offload_min_batch()}-w" + ("p" if OUTPUT_ARGMAX else "")  # "p": rows picked there
    if graph_sizes:
        mode += "-g" + ".".join(map(str, graph_sizes))
    attn = {None: "fa-auto", True: "fa", False: "nofa"}[flash_attn]
    return f"{Path(path).name}-{st.st_size}-{st.st_mtime_ns}-t{n_threads}-{mode}-{attn}-{VERSION}{tag}"


def context_key(ctx: LlamaContext, tag: str = "") -> str:
    return calibration_key(ctx.model.path, ctx.model.params, ctx.n_threads, ctx.params.flash_attn, tag,
                           ctx.graph_sizes)


def time_batch(ctx: LlamaContext, n: int, seq: int, token: int, start: int = 0, repeats: int = REPEATS,
               reduce=min, after_one: bool = False, and_back: bool = False) -> float:
    """Seconds of an n-token batch at positions start..start+n-1 of a scratch sequence, every
    row read as verification reads it (its logits, or its pick where ``ctx`` picks on the
    backend), rolled back after each run; ``after_one``: each run right after an (untimed)
    one-token decode, as a verification follows a plain step; ``and_back``: the one-token decode
    that follows the batch timed with it, as a plain step follows a verification.

    By default the minimum of a few runs: other load on a shared machine only ever adds time,
    and the policy needs the cost of the work itself.
    """
    times = []
    for _ in range(repeats):
        if after_one:
            ctx.decode_rows([token], [start], [[seq]], [True])
            ctx.seq_rm(seq, start, -1)
        t0 = time.perf_counter()
        rows = ctx.decode_rows([token] * n, range(start, start + n), [[seq]] * n, [True] * n)
        _read_rows(ctx, rows, n)
        if and_back:
            ctx.seq_rm(seq, start, -1)
            _read_rows(ctx, ctx.decode_rows([token], [start], [[seq]], [True]), 1)
        times.append(time.perf_counter() - t0)
        ctx.seq_rm(seq, start, -1)
    return reduce(times)


def _read_rows(ctx: LlamaContext, rows, n: int) -> None:
    for i in range(n):
        rows.greedy(i) if ctx.picking else rows(i)


def graphs_warm_up(ctx: LlamaContext) -> bool:
    """Whether batch sizes must be warmed up before they are timed: a context with layers on a
    GPU of a build that runs CUDA graphs (WARMUPS)."""
    return ctx.model.params.n_gpu_layers != 0 and cuda_graphs(system_info()["system_info"]) is not None


def fill_context(ctx: LlamaContext, seq: int, token: int, start: int, end: int) -> None:
    """Decodes filler tokens at positions start..end-1 of ``seq`` (in n_batch chunks), so that
    timed batches attend to a context of ``end`` tokens."""
    for pos in range(start, end, ctx.n_batch):
        n = min(ctx.n_batch, end - pos)
        ctx.decode_rows([token] * n, range(pos, pos + n), [[seq]] * n, [False] * (n - 1) + [True])


def largest_batch(ctx: LlamaContext) -> int:
    """The largest batch a verification on ``ctx`` can be: every row's logits are read."""
    return min(ctx.n_batch, ctx.n_outputs_max)


def measure_verify(ctx: LlamaContext, sizes=BATCH_SIZES) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Target time per batch size; uses the last sequence id, which must be empty."""
    seq = ctx.n_seq_max - 1
    token = ctx.model.tokenize(" the", add_special=False)[0]
    sizes = tuple(n for n in sizes if n <= largest_batch(ctx))
    start = max(0, min(CONTEXT_TOKENS, ctx.n_ctx - 2 * max(sizes, default=1)))
    warm = graphs_warm_up(ctx)
    ctx.pick_on_backend(True, every_row=True)  # as greedy verification reads its rows
    try:
        fill_context(ctx, seq, token, 0, start)
        time_batch(ctx, 1, seq, token, start)  # warm-up: the first decode faults pages in
        one = time_batch(ctx, 1, seq, token, start) if warm else 0.0
        times = []
        for n in sizes:
            if warm:
                time_batch(ctx, n, seq, token, start, repeats=WARMUPS)
            if warm and n > 1:  # the round trip from a plain step and back, less a plain step
                trip = time_batch(ctx, n, seq, token, start, after_one=True, and_back=True)
                times.append(max(trip - one, one))  # never below a plain step, whatever the noise
            else:
                times.append(time_batch(ctx, n, seq, token, start))
        return sizes, tuple(times)
    finally:
        ctx.pick_on_backend(False)
        ctx.seq_rm(seq, -1, -1)


def measure_draft_token(ctx: LlamaContext) -> float:
    """Seconds per drafted token of a model drafter: a one-token decode and the greedy pick of
    its row (sampling.greedy_logprob), as a greedy chain pays them. The pick is a sixth of the
    0.5B's token on a GPU (0.21 against 1.26 ms). A sampled chain's
    pick (sampling.target_support and a draw) costs about as much: 0.28 against 0.25 ms on the
    real 0.5B's rows on the dev VM."""
    token = ctx.model.tokenize(" the", add_special=False)[0]
    seq = ctx.n_seq_max - 1
    time_batch(ctx, 1, seq, token)
    decode_s = time_batch(ctx, 1, seq, token)
    row = ctx.decode([token], [0], [[seq]], [True])[0]
    ctx.seq_rm(seq, 0, -1)
    return decode_s + time_pick(row)


def time_pick(row, repeats: int = 8) -> float:
    """Seconds of the greedy pick of a logits row, the fastest of ``repeats``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        greedy_logprob(row)
        times.append(time.perf_counter() - t0)
    return min(times)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, obj: dict) -> None:
    # A read-only or full store warns once and the caller keeps the measured costs for this
    # run: a cache that cannot be written must not stop a run that needs no cache.
    write_or_keep(path, json.dumps(obj), "the calibration")


def verify_path(home: Path, key: str) -> Path:
    return home / "calibration" / f"verify-{key}.json"


def draft_path(home: Path, key: str) -> Path:
    return home / "calibration" / f"draft-{key}-{DRAFT_VERSION}.json"


def cached_verify(home: Path, key: str) -> CostModel | None:
    """The verify curve cached under ``key`` (no drafter cost), or None."""
    d = _read(verify_path(home, key))
    try:
        return CostModel(tuple(d["batch_sizes"]), tuple(d["verify_s"])) if d else None
    except (KeyError, TypeError):
        return None


def cached_draft_cost(home: Path, key: str) -> float | None:
    """Seconds per drafted token cached under a drafter's ``key``, or None."""
    d = _read(draft_path(home, key))
    value = d.get("draft_token_s") if isinstance(d, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def verify_costs(target: LlamaContext, home: Path, tag: str = "", largest: int | None = None) -> CostModel:
    """The target's verify curve for batches of up to ``largest`` tokens (None: every size),
    measured once per configuration (``tag``: placements the parameters do not show, e.g.
    file-backed weights). Sizes missing from the cached curve are measured and merged into it."""
    key = context_key(target, tag)
    cached = cached_verify(home, key)
    have = dict(zip(cached.batch_sizes, cached.verify_s)) if cached is not None else {}
    missing = tuple(n for n in sizes_up_to(largest) if n not in have and n <= largest_batch(target))
    if cached is not None and not missing:
        return cached
    log.info("calibrating verification costs for %s (once)", Path(target.model.path).name)
    have.update(zip(*measure_verify(target, missing)))
    sizes = tuple(sorted(have))
    times = tuple(have[n] for n in sizes)
    _write(verify_path(home, key), {"batch_sizes": sizes, "verify_s": times})
    return CostModel(sizes, times)


def draft_cost(home: Path, key: str, measure) -> float:
    """A drafter's seconds per drafted token: cached under ``key``, else ``measure()`` and cache."""
    cost = cached_draft_cost(home, key)
    if cost is None:
        cost = float(measure())
        _write(draft_path(home, key), {"draft_token_s": cost})
    return cost


def cost_model(target: LlamaContext, drafter: LlamaContext | None, home: Path, tag: str = "",
               largest: int | None = None) -> CostModel:
    """The calibrated cost model of ``target`` with a llama.cpp ``drafter`` (or none)."""
    verify = verify_costs(target, home, tag, largest)
    if drafter is None:
        return verify
    return replace(verify, draft_token_s=draft_cost(home, context_key(drafter), lambda: measure_draft_token(drafter)))
