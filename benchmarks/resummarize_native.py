"""Re-summarizes a bench JSON recorded before native peers' tok/s left out their end-of-generation
token (edgespec.bench.peers.parse_run): prints the ratios over native plain as recorded and with
that token taken out of the peers' counts. The records' times are unchanged.

    .venv/bin/python benchmarks/resummarize_native.py benchmarks/results/validation-specbench-limit5.json
"""
from __future__ import annotations

import json
import sys
from dataclasses import fields

from edgespec.bench.summary import Record, summarize

NAMES = {f.name for f in fields(Record)}


def records(doc: dict, fix: bool) -> list[Record]:
    out = []
    for r in doc["records"]:
        r = {k: v for k, v in r.items() if k in NAMES}
        # parse_run stored new_tokens = decoded - 1 and gen_tokens = decoded for a stopped run
        if fix and r["config"].startswith("peer:llama.cpp") and r.get("gen_tokens") == r["new_tokens"] + 1:
            r["gen_tokens"] = r["new_tokens"]
        out.append(Record(**r))
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for fix in (False, True):
            print(f"{path}: over native plain, {'end-of-generation left out' if fix else 'as recorded'}")
            for cfg, row in summarize(records(doc, fix)).items():
                cells = " ".join(f"{g}={c['speedup_native']:.2f}x" for g, c in row.items() if c["speedup_native"])
                print(f"  {cfg}: {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
