"""The machine as the planner sees it: RAM (available, not free), cores, CPU features, the GPUs
of the installed llama.cpp build and its limits, and the default budgets derived from them."""
from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass

import psutil

from edgespec.llama import backend

MiB = 1 << 20
BUDGET_MARGIN_FRACTION = 0.05
BUDGET_MARGIN_MIN = 256 * MiB

# =============================================================================================
# The machine
# =============================================================================================

@dataclass(frozen=True)
class GPUDevice:
    name: str
    description: str
    type: str                 # "gpu" or "igpu"
    memory_free: int
    memory_total: int


@dataclass(frozen=True)
class MachineInfo:
    """RAM, cores and accelerators as psutil and the installed llama.cpp build see them."""

    ram_total: int
    ram_available: int
    physical_cores: int
    logical_cores: int
    usable_cpus: int          # CPUs this process may run on (affinity, cgroup cpusets)
    cpu_features: frozenset = frozenset()
    gpu_offload: bool = False
    gpus: tuple[GPUDevice, ...] = ()
    unified_memory: bool = False   # GPU memory is the same RAM (Jetson, Apple silicon, iGPUs)
    mmap_supported: bool = True
    mlock_supported: bool = True
    memlock_limit: int | None = None   # RLIMIT_MEMLOCK in bytes; None: unlimited
    privileged: bool = False           # root may lock any amount

    @property
    def qmatmul(self) -> bool:
        """Whether llama.cpp's CPU backend here takes edgespec's kernels (native/qmatmul)."""
        return "QMATMUL" in self.cpu_features

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_features"] = sorted(self.cpu_features)
        return d


def _features(system_info: str) -> frozenset:
    return frozenset(m.group(1) for m in re.finditer(r"([A-Z0-9_]+) = 1", system_info))


# A GPU whose memory is within this fraction of system RAM shares it (Jetson boards report the
# board's RAM as the CUDA device's memory).
UNIFIED_RAM_FRACTION = 0.10


def _is_unified(gpus: list[dict], ram_total: int) -> bool:
    """Whether the GPU draws on system RAM: an integrated GPU, a Tegra/Jetson board, Apple
    silicon, or a device whose memory equals system RAM."""
    if any(d.get("type") == "igpu" for d in gpus):
        return True
    if any(abs(int(d.get("memory_total", 0)) - ram_total) <= UNIFIED_RAM_FRACTION * ram_total for d in gpus):
        return True
    if os.path.exists("/etc/nv_tegra_release"):
        return True
    try:
        with open("/proc/device-tree/model", "rb") as f:
            model = f.read().decode(errors="replace").lower()
        if "jetson" in model or "tegra" in model:
            return True
    except OSError:
        pass
    return platform.system() == "Darwin" and platform.machine() == "arm64" and bool(gpus)


def machine() -> MachineInfo:
    """Reads this machine: RAM (available, not free), cores, llama.cpp's devices and limits."""
    vm = psutil.virtual_memory()
    info = backend.system_info()
    gpus = [d for d in info.get("devices", []) if d.get("type") in ("gpu", "igpu")]
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = psutil.cpu_count(logical=True) or 1
    limit: int | None = None
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = None if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, OSError, ValueError):
        limit = 0
    return MachineInfo(
        ram_total=int(vm.total),
        # Unified-memory boards share RAM with the GPU: "available" (free + reclaimable
        # caches) is what can be had, "free" is not.
        ram_available=int(vm.available),
        physical_cores=int(psutil.cpu_count(logical=False) or os.cpu_count() or 1),
        logical_cores=int(psutil.cpu_count(logical=True) or os.cpu_count() or 1),
        usable_cpus=usable,
        # QMATMUL: the CPU backend carries edgespec's qmatmul, which takes Q4_K unrepacked
        cpu_features=_features(info.get("system_info", "")) | ({"QMATMUL"} if info.get("qmatmul") else set()),
        gpu_offload=bool(info.get("gpu_offload")),
        gpus=tuple(GPUDevice(d["name"], d.get("description", ""), d["type"], int(d["memory_free"]),
                             int(d["memory_total"])) for d in gpus) if info.get("gpu_offload") else (),
        unified_memory=_is_unified(gpus, int(vm.total)),
        mmap_supported=bool(info.get("mmap", True)),
        mlock_supported=bool(info.get("mlock", False)),
        memlock_limit=limit,
        privileged=hasattr(os, "geteuid") and os.geteuid() == 0,
    )


def default_ram_budget(m: MachineInfo) -> int:
    """Available RAM minus a margin of 5% of the total (at least 256 MiB)."""
    return max(0, m.ram_available - max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_FRACTION * m.ram_total)))


def default_vram_budget(m: MachineInfo) -> int:
    """Free memory of the first GPU minus 5% of its total (at least 256 MiB); 0 without one."""
    if not m.gpus:
        return 0
    g = m.gpus[0]
    return max(0, g.memory_free - max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_FRACTION * g.memory_total)))


def default_threads(m: MachineInfo) -> int:
    return max(1, min(m.physical_cores, m.usable_cpus))


