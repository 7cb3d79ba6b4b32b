"""`edgespec doctor`: what this machine and the installed llama.cpp build can do."""
from __future__ import annotations

import platform

import psutil
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgespec import __version__
from edgespec.llama import backend
from edgespec.cli import app
from edgespec.cli.common import print_json
from edgespec.units import format_bytes as human_bytes
from edgespec.files.store import ModelStore
from edgespec.decode.tokens import HAVE_NATIVE
from edgespec.onnx import providers as onnx_providers_mod
from edgespec.onnx.providers import NAMES, short_name
from edgespec.memory.machine import machine
from edgespec.memory.placements import MODES, unavailable
from edgespec.llama.kernels import cuda_graphs, op_offload_min_batch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def onnx_providers() -> dict:
    """onnxruntime's execution providers here and the --onnx-provider name each answers to."""
    have = onnx_providers_mod.present()
    if have is None:
        return {"onnxruntime": None, "providers": [], "usable": ["cpu"], "names": list(NAMES)}
    import onnxruntime

    providers = [{"name": full, "onnx_provider": short_name(full)} for full in have]
    usable = [p["onnx_provider"] for p in providers if p["onnx_provider"]]
    return {"onnxruntime": onnxruntime.__version__, "providers": providers,
            "usable": usable or ["cpu"], "names": list(NAMES)}


def placements_here() -> dict:
    """Each placement mode (edgespec.memory.placements) and whether this machine can run it."""
    why = unavailable(machine())
    return {name: {"available": name not in why, "what": p.help, **({"why_not": why[name]} if name in why else {})}
            for name, p in MODES.items()}


GRAPHS_SAY = {
    "per-shape": "one per batch shape (edgespec's llama.cpp patch): verification sizes keep theirs",
    "per-context": "one per context: a decode whose batch size changed runs without it "
                   "(`make demo GPU=cuda` builds llama.cpp with one per batch shape)",
    "disabled": "off: GGML_CUDA_DISABLE_GRAPHS is set",
}


def collect() -> dict:
    """Everything doctor reports, as one JSON-ready dict."""
    info = backend.system_info()
    vm = psutil.virtual_memory()
    store = ModelStore()
    return {
        "edgespec": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": _cpu_model(), "physical_cores": psutil.cpu_count(logical=False),
                "logical_cores": psutil.cpu_count(logical=True),
                "features": info["system_info"]},
        # Unified-memory boards (Jetson) share RAM with the GPU: "available" is what counts.
        "ram": {"total": vm.total, "available": vm.available},
        "llama_cpp": {"llama_cpp_python": info["llama_cpp_python"], "gpu_offload": info["gpu_offload"],
                      "mmap": info["mmap"], "mlock": info["mlock"], "devices": info["devices"],
                      "qmatmul": info["qmatmul"], "op_offload_min_batch": op_offload_min_batch(),
                      "cuda_graphs": cuda_graphs(info["system_info"])},
        "native_extensions": HAVE_NATIVE,
        "onnx": onnx_providers(),
        "placements": placements_here(),
        "store": {"home": str(store.home), "models": [e.to_dict() for e in store.list()]},
    }


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Show the CPU, memory, GPU support of llama.cpp, onnxruntime's providers and the model store."""
    d = collect()
    if as_json:
        print_json(d)
        return
    out = Console(highlight=False)
    t = Table(show_header=False, box=None)
    t.add_row("edgespec", f"{d['edgespec']} (Python {d['python']}, native extensions: "
              f"{'yes' if d['native_extensions'] else 'no, pure-Python twins'})")
    t.add_row("platform", d["platform"])
    t.add_row("CPU", f"{d['cpu']['model']} - {d['cpu']['physical_cores']} cores / "
              f"{d['cpu']['logical_cores']} threads")
    t.add_row("CPU features", d["cpu"]["features"])
    t.add_row("RAM", f"{human_bytes(d['ram']['available'])} available of {human_bytes(d['ram']['total'])}")
    lc = d["llama_cpp"]
    t.add_row("llama.cpp", f"llama-cpp-python {lc['llama_cpp_python']}, GPU offload: "
              f"{'yes' if lc['gpu_offload'] else 'no (CPU-only build)'}, mmap: {lc['mmap']}, mlock: {lc['mlock']}")
    t.add_row("  CPU kernels", "edgespec's Q4_K/Q6_K matmul and f16 flash attention: a small batch reads the "
              "weights once, and each row has a one-token decode's bits" if lc["qmatmul"] else "llama.cpp's stock "
              "kernels (`make install` puts edgespec's in a CPU build)")
    for dev in lc["devices"]:
        t.add_row("  device", f"{dev['name']} ({dev['type']}): {dev['description']}, "
                  f"{human_bytes(dev['memory_free'])} free of {human_bytes(dev['memory_total'])}")
    if lc["gpu_offload"]:
        t.add_row("  op offload", f"batches of {lc['op_offload_min_batch']}+ tokens copy a split target's "
                  "CPU weights to the GPU (GGML_OP_OFFLOAD_MIN_BATCH)")
    if lc["gpu_offload"] and lc["cuda_graphs"]:
        t.add_row("  CUDA graphs", GRAPHS_SAY[lc["cuda_graphs"]])
    for name, p in d["placements"].items():
        t.add_row(f"  placement {name}", ("yes: " + p["what"]) if p["available"] else f"no: {p['why_not']}")
    ox = d["onnx"]
    if ox["onnxruntime"] is None:
        t.add_row("onnxruntime", "not installed (--draft onnx unavailable)")
    else:
        t.add_row("onnxruntime", f"{ox['onnxruntime']}, --onnx-provider here: {', '.join(ox['usable'])} "
                  f"(others fall back to cpu)")
        for p in ox["providers"]:
            t.add_row("  provider", f"{p['name']} -> {p['onnx_provider'] or '(not an --onnx-provider name)'}")
    t.add_row("model store", d["store"]["home"])
    for m in d["store"]["models"]:
        state = "present" if m.get("present") else "not pulled"
        if m.get("problem"):
            state = f"[red]CORRUPT[/red]: {escape(m['problem'])}"
        t.add_row(f"  {m.get('name')}", f"{human_bytes(m.get('size') or 0)}, {state}")
    out.print(t)
