"""Measures this machine's cost curves for replay (benchmarks/replay/costs/cpu-dev.json).

Target: verification batches of n tokens (every row's logits, as verification asks) at several
context depths, on the context `edgespec bench` builds; drafter: its batches (syncs) and one-token
decodes, on the drafter's own context. Median of a few repeats. ``policy``: the calibration
the auto drafter reads on this machine (edgespec.drafters.auto.calibrate, cached).

    flock /tmp/edgespec-bench.lock .venv/bin/python benchmarks/replay/measure_cpu.py
"""
from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from edgespec.bench.machine import describe
from edgespec.drafters import DraftConfig, default_draft_model
from edgespec.drafters.factory import load_model_drafter
from edgespec.drafters.auto.calibrate import cost_model, fill_context, time_batch
from edgespec.engine import Engine, EngineConfig

log = logging.getLogger("measure_cpu")
OUT = Path(__file__).resolve().parent / "costs" / "cpu-dev.json"
TARGET_SIZES = (1, 2, 3, 4, 6, 8, 12, 15, 16, 17, 24, 31, 32, 33)
DEPTHS = (128, 512, 1024)
DRAFTER_SIZES = (1, 2, 4, 8, 16, 64, 256, 512)
DRAFTER_DEPTH = 256
REPEATS = 3


def _batch_s(ctx, seq: int, token: int, depth: int, n: int) -> float:
    return time_batch(ctx, n, seq, token, depth, repeats=REPEATS, reduce=statistics.median)


def curves(ctx, depths, sizes) -> dict[int, dict[int, float]]:
    seq, token = ctx.n_seq_max - 1, ctx.model.tokenize(" the", add_special=False)[0]
    out = {}
    try:
        filled = 0
        for depth in depths:  # increasing: each depth extends the context of the one before
            fill_context(ctx, seq, token, filled, depth)
            filled = depth
            _batch_s(ctx, seq, token, depth, 1)  # warm-up
            out[depth] = {n: _batch_s(ctx, seq, token, depth, n) for n in sizes}
            log.info("depth %d: %s", depth, {n: round(s * 1e3, 1) for n, s in out[depth].items()})
    finally:
        ctx.seq_rm(seq, -1, -1)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b", n_ctx=4096, n_seq_max=33))
    name = default_draft_model(engine.model, engine.store)
    drafter = load_model_drafter(engine.model, engine.store.resolve(name), DraftConfig(kind="model", n_ctx=4096))
    try:
        policy = cost_model(engine.ctx, drafter.ctx, engine.store.home)
        target = curves(engine.ctx, DEPTHS, TARGET_SIZES)
        draft = curves(drafter.ctx, (DRAFTER_DEPTH,), DRAFTER_SIZES)[DRAFTER_DEPTH]
        obj = {"name": "cpu-dev", "machine": describe(engine.ctx.n_threads), "target": target, "drafter": draft,
               "policy": {"batch_sizes": list(policy.batch_sizes), "verify_s": list(policy.verify_s),
                          "draft_token_s": policy.draft_token_s}, "step_s": 0.0}
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(obj, indent=1))
        log.info("wrote %s", OUT)
    finally:
        drafter.close()
        engine.close()


if __name__ == "__main__":
    main()
