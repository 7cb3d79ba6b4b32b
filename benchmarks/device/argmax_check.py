"""On a GPU build with output argmax: the backend's picks are the argmax of the rows' logits.

    argmax_check.py TARGET OUT.json [PLACEMENT]

For plain decoding and for suffix speculation on held-out code edits, the greedy answers with
picks on the GPU (every verified row's argmax taken there) against the same engine reading
logits, token for token; then one tree batch (three sequences) read both ways, row for row.
Exits 1 on any difference.
"""
from __future__ import annotations

import json
import sys

from edgespec.bench.prompts import load_suite, prompt_tokens, select
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.llama.rows import OUTPUT_ARGMAX

TOKENS = 128


def answers(target: str, placement: str, on: bool, prompts) -> dict:
    config = EngineConfig(model=target, draft="suffix", placement=placement, greedy_on_backend=on)
    out = {}
    with Engine(config) as engine:
        for draft in (False, True):
            decoder = engine.decoder if draft else Decoder(engine.model, engine.seq)
            for k, p in enumerate(prompts):
                engine.reset()
                tokens = prompt_tokens(engine, p)
                done = decoder.generate(tokens, GenerationRequest(max_tokens=TOKENS, sampling=SamplingParams()))
                out[f"{'spec' if draft else 'plain'}-{k}"] = list(done.token_ids)
            out[f"picking-{'spec' if draft else 'plain'}"] = engine.ctx._greedy.attached
        out["tree"] = tree_rows(engine.ctx, engine.model, on)
    return out


def tree_rows(ctx, model, on: bool) -> list[int]:
    """The greedy token of each row of a three-sequence tree batch after an 8-token prefix."""
    ctx.clear()
    prefix = model.tokenize("def fibonacci(n):\n    return")[:8]
    ctx.pick_on_backend(False)
    ctx.decode_rows(prefix, range(len(prefix)), [[0]] * len(prefix), [False] * len(prefix))
    for s in (1, 2):
        ctx.seq_cp(0, s, 0, len(prefix))
    n = len(prefix)
    ctx.pick_on_backend(on, every_row=True)
    rows = ctx.decode_rows([11, 5, 6], [n, n + 1, n + 1], [[1, 2], [1], [2]], [True] * 3)
    return [rows.greedy(i) for i in range(3)]


def main() -> int:
    target, out_path = sys.argv[1], sys.argv[2]
    placement = sys.argv[3] if len(sys.argv) > 3 else "gpu"
    prompts = select(load_suite("code-edit-test"), 1, "test")[:3]
    logits, picks = (answers(target, placement, on, prompts) for on in (False, True))
    differ = sorted(k for k in logits if not k.startswith("picking") and logits[k] != picks[k])
    report = {"output_argmax_build": OUTPUT_ARGMAX, "placement": placement, "differ": differ,
              "picking_with": {k: picks[k] for k in picks if k.startswith("picking")}, "tree": [logits["tree"], picks["tree"]]}
    print(json.dumps(report))
    with open(out_path, "w") as f:
        json.dump({"report": report, "logits": logits, "picks": picks}, f)
    return 0 if OUTPUT_ARGMAX and not differ and picks["picking-spec"] else 1


if __name__ == "__main__":
    sys.exit(main())
