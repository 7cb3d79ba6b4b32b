"""Where a placement's RAM goes, phase by phase, against what its plan counts (GPU machine, or
the CPU placement anywhere):

    ram.py PLACEMENT TARGET.gguf [--drafter DRAFTER.gguf] [--ram-budget MIB] [--vram-budget MIB] > OUT.json

Resident memory (RSS, and its anonymous part: what a budget cannot get back from the kernel)
after the libraries load, after llama.cpp has enumerated its devices (the CUDA context), after
the engine has loaded the target and the drafter, and the peak during a 64-token request; with
the plan's RAM parts beside them, and after the request the largest mappings by RSS (the heap,
anonymous mappings, each library and model file). A GPU request's RSS was once well above
its plan; this says which phase adds what.
"""
from __future__ import annotations

import edgespec  # noqa: F401  isort: skip  (its import order of llama.cpp, numpy, onnxruntime)

import argparse
import json
import os
import sys
from collections import defaultdict

from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.llama import backend
from edgespec.memory.rss import resident

MiB = 1 << 20
PROMPT = "Write a Python function that merges two sorted lists, with tests."


def phase(name: str, phases: list) -> None:
    r = resident()
    phases.append({"phase": name, "rss_mib": round(r.rss / MiB, 1), "anon_mib": round(r.anon / MiB, 1),
                   "file_mib": round(r.file / MiB, 1), "hwm_mib": round(r.hwm / MiB, 1)})


def mappings(top: int = 14) -> list[dict]:
    """Resident MiB by what is mapped (a file's basename, [heap], [anon], [stack]...), largest first."""
    rss: dict[str, int] = defaultdict(int)
    anon: dict[str, int] = defaultdict(int)
    name = "?"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header
                name = os.path.basename(head[5]) if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                rss[name] += int(head[1])
            elif head[0] == "Anonymous:":
                anon[name] += int(head[1])
    ranked = sorted(rss, key=rss.get, reverse=True)[:top]
    return [{"mapping": n, "rss_mib": round(rss[n] / 1024, 1), "anon_mib": round(anon[n] / 1024, 1)} for n in ranked]


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("placement")
    ap.add_argument("target")
    ap.add_argument("--drafter")
    ap.add_argument("--ram-budget", type=int, help="MiB")
    ap.add_argument("--vram-budget", type=int, help="MiB")
    ap.add_argument("--threads", type=int, default=8, help="CPU threads (8: a laptop)")
    args = ap.parse_args(argv)
    budget = None if args.ram_budget is None else args.ram_budget * MiB
    vram = None if args.vram_budget is None else args.vram_budget * MiB
    phases: list[dict] = []
    phase("libraries", phases)
    devices = backend.list_devices()  # llama.cpp's device query: a CUDA build makes its context here
    phase("devices", phases)
    cfg = EngineConfig(model=args.target, n_ctx=1024, placement=args.placement, ram_budget=budget, vram_budget=vram,
                       n_threads=args.threads,
                       draft="model" if args.drafter else "suffix", draft_model=args.drafter)
    with Engine(cfg) as engine:
        phase("loaded", phases)
        req = GenerationRequest(max_tokens=64, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
        done = engine.chat([{"role": "user", "content": PROMPT}], req)
        phases.append({"phase": "request peak", "rss_mib": round(done.stats.peak_rss_bytes / MiB, 1),
                       "anon_mib": round(done.stats.peak_anon_bytes / MiB, 1)})
        maps = mappings()
        plan = engine.load_plan.plan
        parts = [{"part": p.component, "where": p.where, "mib": round(p.bytes / MiB, 1)} for p in plan.parts]
    return {"placement": args.placement, "ram_budget_mib": args.ram_budget, "vram_budget_mib": args.vram_budget,
            "devices": devices, "plan_ram_mib": round(plan.ram_bytes / MiB, 1),
            "plan_vram_mib": round(plan.vram_bytes / MiB, 1), "phases": phases, "plan_parts": parts,
            "mappings_after_request": maps}


if __name__ == "__main__":
    json.dump(main(sys.argv[1:]), sys.stdout, indent=1, default=str)
    print()
