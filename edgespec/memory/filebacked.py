"""File-backed weights: keep a memory-mapped model out of the resident set.

Under a RAM budget below the weights' size (and no GPU to take layers), llama.cpp maps the
GGUF file and reads the weights straight from the mapping. A forward pass walks through the
layers in order, so every page it touched is done with until the next pass: a watcher thread
drops the mapping's pages from this process's resident set (``madvise(MADV_DONTNEED)``) as
soon as the resident size nears the budget. The pages stay in the kernel's page cache, so the
next pass re-maps them with minor faults instead of disk reads.

Each target pass then costs about the same whatever the number of tokens it verifies: the
weights are streamed once either way. That is where large draft trees pay (SpecExec), and the
calibration of the policy measures exactly that.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
# Headroom under the budget for what the watcher's poll lets a pass fault in before it drops
# the pages, plus the interpreter's jitter between RSS samples (the planner counts it in every
# file-backed plan). Measured with a 600 MiB budget on the 2-core VM (tests/test_budget.py's
# file-backed scenario): peaks 4-18 MiB above the release limit in 8 quiet runs and 52 MiB above
# it once during a full `make test` (the watcher thread scheduled late).
RELEASE_MARGIN = 80 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def find_mappings(path: str) -> list[Mapping]:
    """Address ranges where this process maps ``path`` (from /proc/self/maps)."""
    real = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and os.path.realpath(parts[5].strip()) == real:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append(Mapping(lo, hi))
    except OSError:
        pass
    return out


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def supported() -> bool:
    """Linux with /proc and madvise: the only platform this mode is implemented for."""
    return os.path.exists("/proc/self/maps") and hasattr(os, "sysconf")


class WeightReleaser:
    """Keeps the process's resident size under ``limit_bytes`` by dropping mapped weights.

    Args:
        path: the model file llama.cpp mapped.
        limit_bytes: resident size above which the mapping's pages are dropped; set it below
            the budget by the amount one poll interval can fault in.
        interval_s: how often the watcher looks (reading the resident size costs ~20 us).
    """

    def __init__(self, path: str, limit_bytes: int, interval_s: float = 0.002):
        self.mappings = find_mappings(path)
        if not self.mappings:
            raise RuntimeError(f"{path} is not memory-mapped by this process")
        self.limit_bytes = limit_bytes
        self.interval_s = interval_s
        self.releases = 0
        self._libc = _libc()
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.release()
        self._thread = threading.Thread(target=self._run, name="edgespec-weights", daemon=True)
        self._thread.start()

    @property
    def mapped_bytes(self) -> int:
        return sum(m.size for m in self.mappings)

    def release(self) -> None:
        """Drops every page of the mapped weights from the resident set now."""
        for m in self.mappings:
            if self._libc.madvise(ctypes.c_void_p(m.start), m.size, MADV_DONTNEED) != 0:
                err = ctypes.get_errno()
                log.debug("madvise failed: %s", os.strerror(err))
        self.releases += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._proc.memory_info().rss > self.limit_bytes:
                self.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
