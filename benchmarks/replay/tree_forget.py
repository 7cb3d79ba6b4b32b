"""The drafter's tree search holding every node it decodes (256 sequences, as recorded) against the
search that frees what leaves its top (64 sequences, ModelDrafter today), with the real drafter at
sampled positions of a trace's answers: are the 63-node trees the same, and what do they accept
against the plain answer and against the recorded trace? One line per position, a summary last.

    flock /tmp/edgespec-bench.lock .venv/bin/python benchmarks/replay/tree_forget.py \
        --trace code-edit-validation-16 --prompts 4 --every 12
"""
from __future__ import annotations

import argparse
import time

import replay as rp

from edgespec.drafters.model import MAX_EXPANSIONS, MAX_TREE_NODES, ModelDrafter
from edgespec.drafters.tree_kv import PathKV
from edgespec.files.store import ModelStore
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel
from edgespec.spec.tree_search import accepted_path, best_first, top_children

N_CTX = 4096


def search(ctx, context, forget: bool):
    """The 63-node search after ``context`` (decoded afresh) and its seconds."""
    ctx.clear()
    for i in range(0, len(context), ctx.n_batch):
        part = context[i:i + ctx.n_batch]
        rows = ctx.decode(part, range(i, i + len(part)), [[0]] * len(part), [False] * (len(part) - 1) + [True])
    base, kv = len(context), PathKV(ctx)

    def expand(paths):
        return [top_children(r, 8) for r in kv.decode([(base, p) for p in paths])]

    t0 = time.perf_counter()
    found = best_first(top_children(rows[-1], 8), expand, MAX_TREE_NODES, None, MAX_EXPANSIONS,
                       forget=(lambda ps: kv.forget([(base, p) for p in ps])) if forget else None)
    seconds = time.perf_counter() - t0
    kv.release()
    return found, seconds


def paths(tree) -> set[tuple[int, ...]]:
    return {tuple(int(tree.tokens[i]) for i in tree.path_to(k)) for k in range(len(tree))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--every", type=int, default=12, help="positions between searched ones")
    args = ap.parse_args()
    trace = rp.load_trace(f"benchmarks/replay/traces/{args.trace}.json.gz")
    model = LlamaModel(ModelStore().resolve(trace.meta["draft_model"]))
    held = LlamaContext(model, ContextParams(n_ctx=N_CTX, n_batch=512, n_ubatch=64, n_seq_max=MAX_EXPANSIONS + 1))
    freed = LlamaContext(model, ModelDrafter.context_params(N_CTX))
    print("prompt pos same_tree common_nodes accepted_held accepted_freed accepted_trace expansions_held "
          "expansions_freed s_held s_freed")
    rows = []
    for pt in [p for p in trace.prompts if p.trees is not None][:args.prompts]:
        k = pt.trees.budgets.index(MAX_TREE_NODES)
        for q in range(0, len(pt.trees.accepted), args.every):
            context = list(pt.prompt) + list(pt.output[:q])
            a, ta = search(held, context, False)
            b, tb = search(freed, context, True)
            pa, pb = paths(a.tree), paths(b.tree)
            row = (pt.id, q, pa == pb, len(pa & pb), len(accepted_path(a.tree, pt.output[q:])),
                   len(accepted_path(b.tree, pt.output[q:])), pt.trees.accepted[q][k], a.expansions, b.expansions,
                   ta, tb)
            rows.append(row)
            print(*row[:9], f"{ta:.2f} {tb:.2f}", flush=True)
    n = len(rows)
    print(f"{n} positions: same tree {sum(r[2] for r in rows)}, mean common nodes {sum(r[3] for r in rows) / n:.1f} "
          f"of {MAX_TREE_NODES}, same accepted {sum(r[4] == r[5] for r in rows)}, freed == trace "
          f"{sum(r[5] == r[6] for r in rows)}, held == trace {sum(r[4] == r[6] for r in rows)}, mean expansions "
          f"{sum(r[7] for r in rows) / n:.1f} / {sum(r[8] for r in rows) / n:.1f}, search s "
          f"{sum(r[9] for r in rows):.1f} / {sum(r[10] for r in rows):.1f}")


if __name__ == "__main__":
    main()
