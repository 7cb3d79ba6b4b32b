"""Would a drafter with fewer layers pay? Cuts transformer blocks out of a GGUF drafter (no
retraining) and measures its teacher-forced top-1 agreement with the target's recorded plain
output: for greedy chains, that agreement at each position decides every chain's accepted length.

    .venv/bin/python benchmarks/pruned_drafter.py --trace benchmarks/replay/traces/specbench-30.json.gz \\
        --drop 19,20 --drop 17,18,19,20 --drop 16,17,18,19,20,21 --drop 2,3

The full drafter's agreement is measured too and must match the trace's own (its ``top_ids``),
which checks the method. Scratch copies go to --work (one at a time, ~430 MB each).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

import gguf
import numpy as np

from edgespec.files.store import ModelStore
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel


def prune(src: Path, out: Path, drop: set[int]) -> int:
    """Writes ``src`` without the blocks in ``drop`` (the rest renumbered); returns blocks kept."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    n = r.fields[f"{arch}.block_count"].contents()
    keep = {old: new for new, old in enumerate(i for i in range(n) if i not in drop)}
    w = gguf.GGUFWriter(out, arch, endianess=r.endianess)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            w.add_uint32(name, len(keep))
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    tensors = []
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m and int(m.group(1)) not in keep:
            continue
        tensors.append((f"blk.{keep[int(m.group(1))]}.{m.group(2)}" if m else t.name, t))
    for name, t in tensors:
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t in tensors:
        w.write_tensor_data(t.data)
    w.close()
    return len(keep)


def agreement(path: Path, prompts: list[dict], threads: int) -> float:
    """Mean over prompts of the share of output positions where the drafter's argmax, fed the
    prompt and the plain output before that position, is the plain output's token."""
    model = LlamaModel(path)
    try:
        shares = []
        for p in prompts:
            toks = (p["prompt"] + p["output"])[:2048]
            first = len(p["prompt"]) - 1  # the row that predicts output[0]
            ctx = LlamaContext(model, ContextParams(n_ctx=2048, n_threads=threads))
            preds: list[int] = []
            try:
                for s in range(0, len(toks), 512):
                    chunk = toks[s:s + 512]
                    flags = [first <= s + i < len(toks) - 1 for i in range(len(chunk))]
                    logits = ctx.decode(chunk, list(range(s, s + len(chunk))), [[0]] * len(chunk), flags)
                    preds.extend(logits.argmax(1).tolist())
            finally:
                ctx.close()
            shares.append(np.mean([a == b for a, b in zip(preds, p["output"])]))
        return float(np.mean(shares))
    finally:
        model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--drop", action="append", default=[], help="comma-separated block indices")
    ap.add_argument("--work", type=Path, default=Path("/tmp"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with gzip.open(args.trace) as f:
        trace = json.load(f)
    prompts = trace["prompts"][:args.prompts]
    src = ModelStore().resolve(trace["meta"]["draft_model"])
    recorded = np.mean([np.mean([t[0] == o for t, o in zip(p["drafter"]["top_ids"], p["output"])]) for p in prompts])
    print(f"recorded in the trace: {recorded:.3f}")
    print(f"all blocks: {agreement(src, prompts, args.threads):.3f}")
    for spec in args.drop:
        out = args.work / "pruned-drafter.gguf"
        kept = prune(src, out, {int(x) for x in spec.split(",")})
        print(f"without blocks {spec} ({kept} kept): {agreement(out, prompts, args.threads):.3f}")
        out.unlink()


if __name__ == "__main__":
    main()
