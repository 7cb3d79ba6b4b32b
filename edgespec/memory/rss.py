"""Resident memory of this process: now, its peak during a request, and its peak ever.

The kernel treats two kinds of resident memory differently. File-backed pages (``RssFile``:
the memory-mapped model weights) it can drop at any time and read back from the file; anonymous
and shared-memory pages (``RssAnon + RssShmem``: KV cache, compute buffers, the interpreter) it
cannot drop without swap. A memory limit is hit by the second kind; the first decides how often
the weights are re-read from storage.

``VmHWM`` (the process's peak RSS, what ``ru_maxrss`` reports) only ever grows over the life of
the process, model loading included, so a per-request peak needs sampling.
"""
from __future__ import annotations

import resource
import sys
import threading
from dataclasses import dataclass

import psutil

_STATUS = "/proc/self/status"
_FIELDS = {b"VmRSS:": "rss", b"VmHWM:": "hwm", b"RssAnon:": "anon", b"RssFile:": "file",
           b"RssShmem:": "shmem"}


@dataclass(frozen=True)
class Resident:
    """Bytes resident now, split by what the kernel can reclaim, and the peak of the process."""

    rss: int  # VmRSS = anon + file
    anon: int  # RssAnon + RssShmem: memory the kernel cannot reclaim without swap
    file: int  # RssFile: mapped file pages (the weights) it can drop and re-read
    hwm: int  # VmHWM: peak RSS over the process's life, model loading included


def resident() -> Resident:
    """This process's resident memory, from one read of /proc/self/status (30 us on the dev VM;
    psutil's RSS alone: 9 us).

    Where there is no /proc (macOS, Windows) the split is unknown: all of the RSS is counted as
    ``anon`` (the conservative side for a budget) and the peak is ``ru_maxrss``.
    """
    try:
        with open(_STATUS, "rb") as f:
            status = f.read()
    except OSError:
        return _resident_without_proc()
    kb = {}
    for line in status.splitlines():
        name = _FIELDS.get(line.split(maxsplit=1)[0] if line else b"")
        if name is not None:
            kb[name] = int(line.split()[1])
    if "anon" not in kb:  # kernels before 4.5 lack the split
        return _resident_without_proc()
    return Resident(rss=kb["rss"] << 10, anon=(kb["anon"] + kb.get("shmem", 0)) << 10,
                    file=kb["file"] << 10, hwm=kb["hwm"] << 10)


def _resident_without_proc() -> Resident:
    rss = psutil.Process().memory_info().rss
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm = maxrss if sys.platform == "darwin" else maxrss << 10  # bytes on macOS, KiB elsewhere
    return Resident(rss=rss, anon=rss, file=0, hwm=max(hwm, rss))


class PeakRSS:
    """Context manager that records the largest resident sizes seen while it is open.

    Attributes (bytes):
        peak: largest RSS sampled.
        peak_anon: largest ``anon`` sampled (not necessarily at the same moment as ``peak``).
        process_peak: the process's ``VmHWM`` at exit: its peak RSS ever, loading included.
    """

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak = self.peak_anon = self.process_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> Resident:
        r = resident()
        self.peak = max(self.peak, r.rss)
        self.peak_anon = max(self.peak_anon, r.anon)
        return r

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakRSS":
        self._sample()
        self._thread = threading.Thread(target=self._run, name="edgespec-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # The kernel's own high-water mark covers moments between samples too.
        self.process_peak = max(self._sample().hwm, self.peak)
