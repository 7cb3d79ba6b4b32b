"""Describes the machine and software a benchmark ran on, for its JSON report."""
from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import psutil

from edgespec import __version__
from edgespec.llama import backend


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def describe(threads: int) -> dict:
    info = backend.system_info()
    return {
        "cpu": _cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "threads": threads,
        "ram_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": info["llama_cpp_python"],
        "llama_cpp_system_info": info["system_info"],
        "gpu_offload": info["gpu_offload"],
        "edgespec": __version__,
        "git_commit": _git_commit(),
    }
