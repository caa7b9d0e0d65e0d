"""Keep freed weight-sized memory from lingering in a serving process's RSS.

glibc serves large allocations with mmap and returns them to the OS on free, but it raises that
threshold (up to 32 MiB) each time such a block is freed. After that, weight-sized temporaries
come from the heap and stay resident when freed. A vLLM reload of a 1 GiB model, which
allocates and frees each layer's tensors, then left 2.1-2.3 GiB more in RSS than before the
first sync (measured with benchmarks/bench_server.py). With the threshold fixed at 1 MiB the RSS
stayed flat across syncs. The setting is process-wide and only affects where large blocks come
from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["return_large_frees_to_os"]

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def return_large_frees_to_os(threshold_bytes: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at `threshold_bytes`; False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; large frees may stay in RSS")
    return done
