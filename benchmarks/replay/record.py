"""Records replay traces (replay.py) for a benchmark suite with the real models.

Per prompt, exactly as `edgespec bench --share-prefill` runs plain decoding (same engine
settings, prompts in file order, the prompt's head shared in the KV cache): the plain greedy
output; then the drafter model teacher-forced over prompt + output (one batched pass) and
its free-running chains at every confident miss. Writes gzip JSON after every prompt.

Run under the benchmark lock on a shared machine:
    flock /tmp/edgespec-bench.lock .venv/bin/python benchmarks/replay/record.py \
        --suite specbench --limit 5 --max-tokens 256 --out benchmarks/replay/traces/specbench.json.gz

``--redraft``: keep the trace's prompts, plain outputs and tree records, record the drafter's
part again (a trace from before the off-path confidences were kept); minutes, not an hour.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

import replay as rp

from edgespec.bench.machine import describe
from edgespec.bench.prompts import load_suite, select
from edgespec.bench.runner import _prompt_tokens, _share_prefill
from edgespec.decode.loop import Decoder
from edgespec.drafters import DraftConfig, default_draft_model
from edgespec.drafters.factory import load_model_drafter
from edgespec.drafters.model import MAX_TREE_NODES
from edgespec.engine import Engine, EngineConfig
from edgespec.memory.placements import CHAINS

log = logging.getLogger("record")
DRAFTER_CTX = 8192  # prompt + output + 63 off-path chains of up to 31 tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", required=True)
    ap.add_argument("--limit", type=int, default=None, help="prompts per category (bench --limit)")
    ap.add_argument("--split", default="tune", help="one of edgespec.bench.prompts.SPLITS (bench --split)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-max", type=int, default=CHAINS.draft_max)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--redraft", action="store_true", help="re-record only the drafter's part of --out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    settings = EngineConfig(n_threads=args.threads, draft_max=args.draft_max)
    prompts = select(load_suite(args.suite), args.limit, args.split)
    engine = Engine(EngineConfig(model=settings.model, n_ctx=settings.n_ctx, n_threads=settings.n_threads,
                                 n_seq_max=settings.draft_max + 1))
    name = default_draft_model(engine.model, engine.store)
    cfg = DraftConfig(kind="model", n_ctx=DRAFTER_CTX, n_threads=settings.n_threads)
    drafter = load_model_drafter(engine.model, engine.store.resolve(name), cfg)
    assert drafter.ctx.n_seq_max == MAX_TREE_NODES + 1
    meta = {"model": settings.model, "draft_model": name, "draft_max": settings.draft_max,
            "n_ctx": settings.n_ctx, "share_prefill": True, "limit": args.limit, "split": args.split,
            "machine": describe(engine.ctx.n_threads), "plain_gen_s": {}, "record_s": {}}
    done: list[rp.PromptTrace] = []
    try:
        if args.redraft:
            return redraft(args.out, drafter, settings.draft_max - 1)
        for k, p in enumerate(prompts):
            t0 = time.perf_counter()
            tokens = _prompt_tokens(engine, p)
            _share_prefill(engine.seq, tokens)
            t1 = time.perf_counter()
            output, finish = rp.record_plain(Decoder(engine.model, engine.seq), tokens, args.max_tokens)
            meta["plain_gen_s"][p.id] = time.perf_counter() - t1
            d = rp.record_drafter(drafter.ctx, tokens, output, drafter.min_confidence, settings.draft_max - 1)
            done.append(rp.PromptTrace(p.id, p.category, tuple(tokens), output, finish, d))
            meta["record_s"][p.id] = time.perf_counter() - t0
            rp.save_trace(rp.Trace(args.suite, args.max_tokens, tuple(done), meta), args.out)
            misses = sum(1 for q, c in enumerate(d.confident_at) if c and d.top(q) != output[q])
            log.info("%d/%d %s: %d prompt + %d output tokens (%s), %d confident misses, %.1f s", k + 1, len(prompts),
                     p.id, len(tokens), len(output), finish, misses, meta["record_s"][p.id])
    finally:
        drafter.close()
        engine.close()


def redraft(path: Path, drafter, off_cap: int) -> None:
    """Records the drafter's part of every prompt of the trace at ``path`` again, in place,
    with the settings it was recorded with (``off_cap`` where it has none)."""
    trace = rp.load_trace(path)
    done = []
    for k, p in enumerate(trace.prompts):
        t0 = time.perf_counter()
        old = p.drafter
        confidence, cap = (old.min_confidence, old.off_cap) if old else (drafter.min_confidence, off_cap)
        d = rp.record_drafter(drafter.ctx, p.prompt, p.output, confidence, cap)
        if old is not None and [t[0] for t in d.top_ids] != [t[0] for t in old.top_ids]:
            log.warning("%s: the drafter's greedy tokens differ from the first recording", p.id)
        done.append(replace(p, drafter=d))
        log.info("%d/%d %s: %.1f s", k + 1, len(trace.prompts), p.id, time.perf_counter() - t0)
    rp.save_trace(replace(trace, prompts=tuple(done)), path)


if __name__ == "__main__":
    main()
