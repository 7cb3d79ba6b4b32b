"""The plans the planner makes now for the layouts `run.sh ram` measured, beside the request
peaks measured then (the plans of 2026-11-28, benchmarks/LOG.md): the same clone files
(made here by measure.py clones from the carried headers, seed 1, as on the GPU machine) and
the GPU machine as its results describe it, planned as ram.py's engine plans them.

    .venv/bin/python benchmarks/device/ram_plans.py benchmarks/device/results/engine-ram-h200.json /tmp/clones
"""
from __future__ import annotations

import edgespec  # noqa: F401  isort: skip  (its import order of llama.cpp, numpy, onnxruntime)

import json
import os
import sys

from edgespec.files.modelfile import model_file

from edgespec.memory.footprint import footprint_of
from edgespec.memory import planner

MiB, GiB = 1 << 20, 1 << 30
# name in the results: placement, target clone, with the drafter, VRAM budget (MiB)
LAYOUTS = {"cpu-7b": ("cpu", "qwen7b", False, None), "draft-gpu-7b": ("draft-gpu", "qwen7b", True, None),
           "draft-gpu-1.5b": ("draft-gpu", "qwen1.5b", True, None), "gpu-1.5b": ("gpu", "qwen1.5b", True, None),
           "gpu-1.5b-suffix": ("gpu", "qwen1.5b", False, None), "gpu-7b": ("gpu", "qwen7b", True, None),
           "offload-7b": ("offload", "qwen7b", True, 1744)}


def machine_of(result: dict) -> planner.MachineInfo:
    """The GPU machine as ram.py's devices list describes it (16 cores, AVX-512)."""
    gpu, cpu = result["devices"][0], result["devices"][1]
    return planner.MachineInfo(
        ram_total=cpu["memory_total"], ram_available=cpu["memory_free"], physical_cores=16, logical_cores=16,
        usable_cpus=16, gpu_offload=True, cpu_features=frozenset(
            {"AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16", "BMI2", "SSE3", "SSSE3"}),
        gpus=(planner.GPUDevice(gpu["name"], gpu["description"], gpu["type"], gpu["memory_free"],
                                gpu["memory_total"]),))


def main(results: str, models: str) -> None:
    with open(results) as f:
        measured = json.load(f)
    drafter = footprint_of(model_file(os.path.join(models, "qwen0.5b.gguf")))
    # recorded: the plan ram.py recorded (its runtime part, not the pinned compute buffer yet);
    # before: that plan without the runtime part, as the planner had it before the runtime part
    print("| layout | request peak MiB | plan before | plan recorded | plan now | spare |")
    print("|---|---|---|---|---|---|")
    for name, (placement, target, with_drafter, vram) in LAYOUTS.items():
        r = measured[f"engine-ram-{name}.json"]
        plan = planner.make_plan(footprint_of(model_file(os.path.join(models, target + ".gguf"))),
                                 drafter if with_drafter else None, ram_budget=100 * GiB,
                                 vram_budget=vram and vram * MiB, n_ctx=1024, machine_info=machine_of(r),
                                 suffix=not with_drafter, placement=placement, threads=8, long_drafts=False)
        peak, now = r["phases"][-1]["rss_mib"], plan.ram_bytes / MiB
        runtime = sum(p["mib"] for p in r["plan_parts"] if p["part"] == "GPU runtime (host)")
        print(f"| {name} | {peak:.1f} | {r['plan_ram_mib'] - runtime:.1f} | {r['plan_ram_mib']:.1f} | {now:.1f} "
              f"| {(now - peak) / peak:+.1%} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
