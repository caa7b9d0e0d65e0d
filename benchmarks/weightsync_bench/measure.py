"""Reference speeds (single-thread memcpy, pinned host-to-device copy), peak RSS growth, and the
environment a run records."""

from __future__ import annotations

import math
import os
import platform
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil
import torch

from weightsync.pack import STREAMING_COPY
from weightsync_bench.config import GIB

__all__ = ["PeakRss", "environment", "h2d_gbps", "loader_copy_gbps", "memcpy_gbps", "status_bytes"]


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "libc": " ".join(platform.libc_ver()),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "copy_routine": "native streaming stores" if STREAMING_COPY else "numpy.copyto",
    }


def memcpy_gbps(num_bytes: int = GIB, rounds: int = 3) -> float:
    """Single-thread `numpy.copyto` between two pre-faulted buffers, best of `rounds`, GB/s."""
    source = np.ones(num_bytes, dtype=np.uint8)
    target = np.ones(num_bytes, dtype=np.uint8)
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def loader_copy_gbps(num_bytes: int = GIB, piece_bytes: int = 64 << 20, rounds: int = 3) -> float:
    """`torch.Tensor.copy_` of `num_bytes` in `piece_bytes` tensors between pre-faulted buffers,
    with torch's default threads, best of `rounds`, GB/s.

    This is how an engine's loader copies each tensor it is handed (vLLM's default weight
    loader, verl's and SGLang's bucket callbacks): the ceiling of a callable sink, whose last
    copy is the loader's, not weightsync's.
    """
    piece_bytes = min(piece_bytes, num_bytes)
    count = num_bytes // piece_bytes
    source = torch.ones(piece_bytes, dtype=torch.uint8)
    targets = [torch.ones(piece_bytes, dtype=torch.uint8) for _ in range(count)]
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        for target in targets:
            target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return count * piece_bytes / best / 1e9


def h2d_gbps(num_bytes: int = GIB, rounds: int = 3) -> float:
    """One pinned host-to-device copy of `num_bytes` (the best a bucket can cross PCIe), best of `rounds`, GB/s."""
    source = torch.ones(num_bytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    best = math.inf
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A size field of a process's /proc/PID/status, in bytes: its peak (VmHWM) or current (VmRSS)
    resident set size, say; this process's by default."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no {field}")


class PeakRss:
    """Growth of this process's peak RSS between `start()` and `stop()`, in bytes."""

    def __init__(self) -> None:
        self._before = 0
        self._sampled = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # reset VmHWM to the current RSS
            self._before = status_bytes("VmRSS")
        except OSError:
            self._start_sampling()

    def _start_sampling(self) -> None:
        process = psutil.Process()
        self._before = self._sampled = process.memory_info().rss
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self._sampled = max(self._sampled, process.memory_info().rss)

        self._sampler = threading.Thread(target=sample, daemon=True, name="weightsync-bench-rss")
        self._sampler.start()

    def stop(self) -> int:
        if self._sampler is None:
            return max(0, status_bytes("VmHWM") - self._before)
        self._stop.set()
        self._sampler.join()
        self._sampler = None
        self._sampled = max(self._sampled, psutil.Process().memory_info().rss)
        return max(0, self._sampled - self._before)
