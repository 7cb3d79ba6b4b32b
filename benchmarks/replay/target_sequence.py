"""The target's decodes as a replay books them, per prompt, for the GPU machine to time as a sequence.

    .venv/bin/python benchmarks/replay/target_sequence.py --trace specbench-30 --costs gpu-7b \
        --config auto --out benchmarks/device/sequences/gpu-7b-specbench-30.json

Writes, for plain decoding and for ``--config``, each prompt's batch sizes in the order the
target decodes them and the seconds the replay booked for them: with CUDA graph misses priced
(``booked_s``) and at the curve's cost alone (``curve_s``). ``measure.py sequence`` then decodes
the same sizes in the same order on the GPU and times them, which checks how the replay prices
a GPU decode that changes its batch's shape. ``--book FILE`` instead prices the sizes of such a
file (as it was timed) on ``--costs`` with ``--graphs``' misses.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import replay as rp
from simulate import add_graphs_flag, load_costs, load_traces


class _Recorder(rp.Ledger):
    """A ledger that also keeps each target decode's size, booked seconds and curve seconds."""

    def __init__(self, costs):
        super().__init__(costs)
        self.decodes: list[tuple[int, float, float]] = []

    def target(self, n: int, depth: int) -> None:
        before = self.target_s
        super().target(n, depth)
        self.decodes.append((n, self.target_s - before, self.costs.verify(n, depth)))


def sequences(trace, config: str, costs, max_tokens: int) -> dict[str, list[list[tuple[int, float, float]]]]:
    """{"plain": per prompt [(n, booked seconds, curve seconds)], config: ...} replayed on ``costs``."""
    settings = rp.ReplaySettings(max_tokens=max_tokens, draft_max=63 if config.endswith(rp.TREE) else 32)
    made: list[_Recorder] = []  # one per run, in the replay's order: plain, config, plain, ...

    def new_ledger(c) -> _Recorder:
        made.append(_Recorder(c))
        return made[-1]

    rp.replay(trace, ["plain", config], costs, settings, new_ledger=new_ledger)
    return {"plain": [r.decodes for r in made[0::2]], config: [r.decodes for r in made[1::2]]}


def book(sizes: dict[str, list[list[int]]], costs) -> dict[str, tuple[float, float]]:
    """{run: (seconds booked with graph misses, seconds at the curve)} for recorded decode sizes,
    each prompt in a fresh ledger at the curve's context depth."""
    out = {}
    for key, prompts in sizes.items():
        decodes = []
        for p in prompts:
            ledger = _Recorder(costs)
            for n in p:
                ledger.target(n, 512)
            decodes += ledger.decodes
        out[key] = (sum(s for _, s, _ in decodes), sum(c for _, _, c in decodes))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="specbench-30")
    ap.add_argument("--costs", default="gpu-7b")
    ap.add_argument("--config", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--book", type=Path, help="price this sequences file's sizes instead of writing one")
    ap.add_argument("--out", type=Path)
    add_graphs_flag(ap)
    args = ap.parse_args()
    costs = load_costs(args.costs, graphs=args.graphs)
    if args.book:
        for key, (booked, curve) in book(json.loads(args.book.read_text())["sizes"], costs).items():
            print(f"{key}: booked {booked:.3f} s ({args.graphs} graphs), at the curve {curve:.3f} s")
        return
    if args.out is None:
        ap.error("--out is required unless --book is given")
    trace, = load_traces(args.trace)
    booked = sequences(trace, args.config, costs, args.max_tokens)
    out = {"trace": args.trace, "costs": args.costs, "config": args.config, "max_tokens": args.max_tokens,
           "graph_miss_s": costs.graph_miss_s, "sizes": {}, "booked_s": {}, "curve_s": {}}
    for key, prompts in booked.items():
        out["sizes"][key] = [[n for n, _, _ in p] for p in prompts]
        out["booked_s"][key] = [sum(s for _, s, _ in p) for p in prompts]
        out["curve_s"][key] = [sum(c for _, _, c in p) for p in prompts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))
    for key in booked:
        print(f"{key}: {sum(map(len, out['sizes'][key]))} decodes, booked {sum(out['booked_s'][key]):.3f} s, "
              f"at the curve {sum(out['curve_s'][key]):.3f} s")


if __name__ == "__main__":
    main()
