"""Replayed vs measured: replays exactly the prompts and configurations of an `edgespec bench
--json` run and compares tokens/s, steps and accepted tokens, per configuration.

    .venv/bin/python benchmarks/replay/validate.py BENCH.json --traces specbench --costs cpu-dev [-v]

Steps and accepted tokens must agree exactly where the run's output equals plain decoding's
(``same_as_plain``), up to drafter near-ties between batched and one-token numerics; where it
does not, the run left the recorded path and its drafts were graded against other text.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from statistics import mean

import replay as rp
from simulate import add_graphs_flag, load_costs, load_traces

from edgespec.bench.summary import PLAIN, Record

log = logging.getLogger("validate")


def compare(bench: dict, traces: list[rp.Trace], costs: rp.MachineCosts) -> tuple[list[Record], list[Record]]:
    """(measured records, replayed records) for the bench's prompts and configs, in bench order."""
    s = bench["settings"]
    settings = rp.ReplaySettings(max_tokens=s["max_tokens"], draft_max=s["draft_max"], n_ctx=s["n_ctx"])
    measured = [Record(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in bench["records"]]
    by_id = {p.id: p for t in traces for p in t.prompts}
    missing = sorted({r.id for r in measured} - set(by_id))
    if missing:
        raise SystemExit(f"no trace for prompts {', '.join(missing)}")
    for t in traces:
        rp.check_settings(t, settings)
    cache: list[int] = []
    replayed = [rp.replay_prompt(by_id[r.id], r.config, costs, settings, cache) for r in measured]
    return measured, replayed


def report(measured: list[Record], replayed: list[Record], verbose: bool) -> str:
    header = ("| config | measured tok/s | replayed tok/s | replayed / measured | speedup measured / replayed "
              "| steps measured / replayed | accepted measured / replayed | output = plain "
              "| steps equal where output = plain |")
    lines = [header, "|---" * 9 + "|"]
    base_m = mean(m.tokens_per_s for m in measured if m.config == PLAIN)
    base_r = mean(r.tokens_per_s for r in replayed if r.config == PLAIN)
    for cfg in dict.fromkeys(r.config for r in measured):
        pairs = [(m, r) for m, r in zip(measured, replayed) if m.config == cfg]
        tm, tr = mean(m.tokens_per_s for m, _ in pairs), mean(r.tokens_per_s for _, r in pairs)
        same = [(m, r) for m, r in pairs if cfg == PLAIN or m.same_as_plain]
        exact = sum(m.steps == r.steps for m, r in same)
        lines.append(f"| {cfg} | {tm:.1f} | {tr:.1f} | {tr / tm:.3f} | {tm / base_m:.2f}x / {tr / base_r:.2f}x | "
                     f"{sum(m.steps for m, _ in pairs)} / "
                     f"{sum(r.steps for _, r in pairs)} | {sum(m.accepted for m, _ in pairs)} / "
                     f"{sum(r.accepted for _, r in pairs)} | {len(same)}/{len(pairs)} | {exact}/{len(same)} |")
        if verbose:
            for m, r in pairs:
                lines.append(f"|  {m.id} | {m.tokens_per_s:.1f} | {r.tokens_per_s:.1f} | "
                             f"{r.tokens_per_s / m.tokens_per_s:.3f} | | {m.steps} / {r.steps} | "
                             f"{m.accepted} / {r.accepted} | {m.same_as_plain} | {m.new_tokens} / {r.new_tokens} tok |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path)
    ap.add_argument("--traces", default="specbench,code-edit")
    ap.add_argument("--costs", default="cpu-dev")
    ap.add_argument("-v", "--verbose", action="store_true")
    add_graphs_flag(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    measured, replayed = compare(json.loads(args.bench.read_text()), load_traces(args.traces),
                                 load_costs(args.costs, graphs=args.graphs))
    print(report(measured, replayed, args.verbose))


if __name__ == "__main__":
    main()
