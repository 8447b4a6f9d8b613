"""Wall time and peak memory (this process and its workers) of each pass of a build."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import psutil


@dataclass
class PassStats:
    name: str
    wall_s: float = 0.0
    peak_rss: int = 0
    skipped: bool = False


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with suppress(psutil.Error):
            total += p.memory_info().rss
    return total


@contextmanager
def measure(stats: PassStats, interval: float = 0.1):
    """Fill ``stats`` with the wall time and the peak summed RSS of the process tree."""
    proc = psutil.Process()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            stats.peak_rss = max(stats.peak_rss, _tree_rss(proc))
            stop.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    try:
        yield stats
    finally:
        stop.set()
        sampler.join()
        stats.peak_rss = max(stats.peak_rss, _tree_rss(proc))
        stats.wall_s = time.perf_counter() - start
