"""Where a speculative greedy answer may part from the plain one: measured near-ties.

A verifier reads logits from a batched row, plain decoding from a one-token row; llama.cpp's
batched kernels move logits a little, so where plain's two best candidates are closer than
that movement the two may pick differently. These functions measure both sides at a
divergence (used by tests/test_speculative.py and tests/test_gpu.py).
"""
from __future__ import annotations

import numpy as np

from edgespec.engine import Engine
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel


def batched_vs_single_deviation(model: LlamaModel, tokens: list[int]) -> float:
    """Largest logit difference between one-token decoding and batches of 2..16 tokens."""
    ctx = LlamaContext(model, ContextParams(n_ctx=512))
    try:
        single = np.array([ctx.decode([t], [i], [[0]], [True])[0] for i, t in enumerate(tokens)])
        worst = 0.0
        for size in (2, 4, 8, 16):
            ctx.clear()
            for s in range(0, len(tokens), size):
                chunk = tokens[s:s + size]
                got = ctx.decode(chunk, range(s, s + len(chunk)), [[0]] * len(chunk), [True] * len(chunk))
                worst = max(worst, float(np.abs(got - single[s:s + len(chunk)]).max()))
        return worst
    finally:
        ctx.close()


def _plain_logits_at(engine: Engine, prompt_tokens: list[int], plain: tuple[int, ...], j: int) -> np.ndarray:
    """The logits plain decoding saw when it chose plain[j] (same one-token numerics)."""
    engine.reset()
    logits = engine.seq.sync(prompt_tokens)[0].logits()
    for k in range(j):
        logits = engine.seq.append(plain[k]).logits()
    engine.reset()
    return logits


# Verification batch shapes (row index + 1, rows) measured at a divergence: drafts of up to 8.
BATCH_SHAPES = ((1, 2), (1, 5), (1, 9), (3, 9), (6, 9))


def _local_deviation(engine: Engine, context: list[int], after: list[int], single: np.ndarray) -> float:
    """How far batched evaluation moves the logits after ``context``: the largest difference
    from ``single`` of the row after the last context token at index m - 1 of a ``size``-row
    batch (the last m context tokens, then ``after`` as drafts), over BATCH_SHAPES."""
    keep = len(context) - max(m for m, _ in BATCH_SHAPES)
    engine.reset()
    engine.seq.sync(context[:keep])  # the prefix every shape shares, evaluated once
    worst = 0.0
    for m, size in BATCH_SHAPES:
        engine.ctx.seq_rm(0, keep, -1)
        lead = context[keep:len(context) - m]
        if lead:
            engine.ctx.decode(lead, range(keep, keep + len(lead)), [[0]] * len(lead), [False] * len(lead))
        rows = context[-m:] + list(after[: size - m])
        base = len(context) - m
        row = engine.ctx.decode(rows, range(base, base + len(rows)), [[0]] * len(rows),
                                [i == m - 1 for i in range(len(rows))])[0]
        worst = max(worst, float(np.abs(row - single).max()))
    engine.reset()
    return worst


def near_tie(engine: Engine, prompt: list[int], plain: tuple[int, ...], spec: tuple[int, ...], j: int) -> dict:
    """How close plain's two candidates were at the first divergence ``j``, and how far batched
    evaluation moves the logits right there.

    A verifier reading a batched row picks spec[j]; plain decoding read a one-token row and
    picked plain[j]. That flip needs gap = L[plain[j]] - L[spec[j]] <= 2 * deviation, the
    largest change batching makes to any logit of that row.
    """
    picking = engine.ctx.picking
    engine.ctx.pick_on_backend(False)  # logits, not the backend's picks
    try:
        single = _plain_logits_at(engine, prompt, plain, j)
        context = list(prompt) + list(plain[:j])
        top2 = np.sort(single)[-2:]
        return {"position": j, "gap": float(single[plain[j]] - single[spec[j]]),
                "top2_gap": float(top2[1] - top2[0]),
                "local_deviation": _local_deviation(engine, context, list(spec[j:]), single)}
    finally:
        engine.ctx.pick_on_backend(picking)
