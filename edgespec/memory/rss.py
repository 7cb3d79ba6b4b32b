"""Peak resident memory of this process, sampled in the background while work runs.

``ru_maxrss`` only ever grows over the life of the process (model loading included), so a
per-request peak needs sampling.
"""
from __future__ import annotations

import threading

import psutil


class PeakRSS:
    """Context manager that records the largest RSS seen while it is open."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process()

    def _sample(self) -> None:
        rss = self._proc.memory_info().rss
        if rss > self.peak:
            self.peak = rss

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
        self._sample()
