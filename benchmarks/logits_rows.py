"""What a drafter's Python costs per row of logits: the greedy pick (token and confidence) and a
tree node's children (top 8 and their log-probabilities), on rows of the real 0.5B drafter, as
drafting computes them now (sampling.logsumexp: exponentials in float32, summed in float64)
against the whole row in float64 (what drafting did before), interleaved in one process.

    .venv/bin/python benchmarks/logits_rows.py [--model qwen2.5-coder-0.5b] [--rows 64] [--save F.npy]
    python3 benchmarks/logits_rows.py --load F.npy      # rows saved here, timed on another CPU
    .venv/bin/python benchmarks/logits_rows.py --gaussian 2 --rows 16   # flat rows, no model

``--load`` needs no model and no llama.cpp build: on the GPU machine, before any build, run it
with an empty ``llama_cpp`` module standing in for the package edgespec imports first (run.sh
``rows`` stage), to time the rows on the CPU that drives the GPU there.

A row's cost is per drafted token (chains) or per expanded node (trees), beside the drafter's
decode: 1.26 ms for the 0.5B on an H100 or H200 (RESULTS-gpu.md sections 18 and 20).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from edgespec.decode.sampling import (
    SamplingParams,
    greedy_logprob,
    recent_window,
    sample_from,
    sample_support,
    target_probs,
    target_support,
)
from edgespec.spec.tree_search import top_children

PROMPT = "def merge(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"


def float64_pick(row: np.ndarray) -> tuple[int, float]:
    x = row.astype(np.float64)
    lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    t = int(np.argmax(lp))
    return t, float(lp[t])


def float64_children(row: np.ndarray, branch: int = 8) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ids = np.argpartition(row, len(row) - branch)[len(row) - branch:]
    x = row.astype(np.float64)
    m = x.max()
    lp = (x[ids] - m) - np.log(np.exp(x - m).sum())
    order = np.lexsort((ids, -lp))
    return tuple(int(i) for i in ids[order]), tuple(float(v) for v in lp[order])


# A sampled chain's pick under the CLI's default sampler (temperature 0.8, top-k 40, top-p 0.95,
# min-p 0.05), with a 64-token repetition window
SAMPLED = SamplingParams(temperature=0.8)
RECENT = recent_window(list(range(64)), SAMPLED)


def vector_pick(row: np.ndarray, rng: np.random.Generator) -> int:
    """A sampled pick over the whole probability vector, as drafting did before target_support
    (its top-k by today's top_ids: the code before both took 1.31 ms, logits-rows.json)."""
    q = target_probs(row, SAMPLED, RECENT)
    q.max(), q[np.flatnonzero(q)]  # draft_chain's confidence test and its record of q
    return sample_from(q, rng)


def support_pick(row: np.ndarray, rng: np.random.Generator) -> int:
    ids, q = target_support(row, SAMPLED, RECENT)
    q.max()  # draft_chain's confidence test
    return sample_support(ids, q, rng)


def rows_of(model: str, n: int) -> list[np.ndarray]:
    """``n`` logits rows of a greedy continuation of PROMPT by ``model``."""
    from edgespec.files.store import ModelStore
    from edgespec.llama.backend import (
        ContextParams,
        LlamaContext,
        LlamaModel,
        ModelParams,
    )

    m = LlamaModel(ModelStore().resolve(model), ModelParams())
    ctx = LlamaContext(m, ContextParams(n_ctx=512, n_batch=512, n_ubatch=512))
    tokens = m.tokenize(PROMPT)
    row = ctx.decode_rows(tokens, range(len(tokens)), [[0]] * len(tokens), [False] * (len(tokens) - 1) + [True])(
        len(tokens) - 1)
    out = []
    for i in range(n):
        out.append(row)
        t = int(np.argmax(row))
        row = ctx.decode_rows([t], [len(tokens) + i], [[0]], [True])(0)
    return out


def timed(fn, rows: list[np.ndarray], repeats: int = 5) -> float:
    """Median ms a row over ``repeats`` passes over the rows."""
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for r in rows:
            fn(r)
        per.append((time.perf_counter() - t0) * 1e3 / len(rows))
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--save", help="also save the rows (.npy)")
    ap.add_argument("--load", help="time rows saved by --save instead of decoding")
    ap.add_argument("--gaussian", type=float, metavar="SD",
                    help="time --rows rows of Gaussian logits of this deviation instead (flat rows, as a "
                         "shape clone's random weights give: 2 puts every token within 16 nats)")
    args = ap.parse_args()
    if args.gaussian:
        rng = np.random.default_rng(0)
        rows = [(rng.standard_normal(151936) * args.gaussian).astype(np.float32) for _ in range(args.rows)]
    else:
        rows = list(np.load(args.load)) if args.load else rows_of(args.model, args.rows)
    if args.save:
        np.save(args.save, np.stack(rows))
    agree_pick = max(abs(greedy_logprob(r)[1] - float64_pick(r)[1]) for r in rows)
    same_pick = all(greedy_logprob(r)[0] == float64_pick(r)[0] for r in rows)
    news = [top_children(r, 8) for r in rows]
    olds = [float64_children(r) for r in rows]
    same_children = all(n.ids == o[0] for n, o in zip(news, olds))
    agree_children = max(abs(a - b) for n, o in zip(news, olds) for a, b in zip(n.logps, o[1]))
    out = {"rows": len(rows), "vocab": len(rows[0]), "ms_per_row": {}}
    rng = np.random.default_rng(0)
    for _ in range(2):  # interleaved: each pair timed twice, the second kept
        out["ms_per_row"] = {"pick float64": timed(float64_pick, rows), "pick now": timed(greedy_logprob, rows),
                             "children float64": timed(float64_children, rows),
                             "children now": timed(lambda r: top_children(r, 8), rows),
                             "sampled pick, whole vector": timed(lambda r: vector_pick(r, rng), rows),
                             "sampled pick now": timed(lambda r: support_pick(r, rng), rows)}
    near = {w: statistics.median(int((r >= r.max() - w).sum()) for r in rows) for w in (16, 20, 32)}
    out.update(same_tokens=same_pick and same_children, max_logp_difference=max(agree_pick, agree_children),
               median_tokens_within_nats=near)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
