"""Where a serving process's large allocations come from, and when freed memory goes back.

Between syncs, freed weight-sized memory must not linger in RSS. glibc serves large allocations
with mmap and returns them to the OS on free, but it raises that threshold (up to 32 MiB) each
time such a block is freed. After that, weight-sized temporaries come from the heap and stay
resident when freed. A vLLM reload of a 1 GiB model, which allocates and frees each layer's
tensors, then left 2.1-2.3 GiB more in RSS than before the first sync (measured with
benchmarks/bench_server.py). With the threshold fixed at 1 MiB (`return_large_frees_to_os`) the
RSS stayed flat across syncs.

During a sync, the opposite serves better. Each layer a vLLM reload materialises is fresh mmap'd
memory that the kernel faults in a 4 KiB page at a time and unmaps again: about 350,000 page
faults per GiB of float32 weights on the 2-core dev host, half of the worker's time in a 1 GiB
push. `reuse_freed_memory` serves every allocation from the heap instead, where what one layer
frees the next one reuses, already resident; `release_freed_memory` then gives the free heap
pages back to the OS (malloc_trim) and returns to `return_large_frees_to_os`'s setting. Measured
in a vLLM worker on the dev host: a 1 GiB push 0.86-0.88 s -> 0.66-0.72 s (back to back, the
quieter runs), 290,000 -> 107,000 page faults, RSS between syncs 0.3 GiB lower, and its peak
during a sync 0.1 GiB higher (the heap keeps the sync's freed temporaries until it ends, and
glibc cannot place every aligned block in a hole an earlier one left).

Every setting is process-wide and only affects where blocks come from. Where libc is not glibc
every function here does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["release_freed_memory", "return_large_frees_to_os", "reuse_freed_memory"]

log = logging.getLogger(__name__)

# glibc's mallopt parameter numbers and defaults (malloc.h, malloc.c)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536
NEVER_TRIM = (1 << 31) - 1
"""The largest trim threshold mallopt takes (an int): no free shrinks the heap."""
LARGE_BYTES = 1 << 20
"""`return_large_frees_to_os`'s mmap threshold."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, with mallopt and malloc_trim typed; None where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def _mallopt(*settings: tuple[int, int]) -> bool:
    libc = _libc()
    if libc is None:
        return False
    done = all([bool(libc.mallopt(parameter, value)) for parameter, value in settings])
    if not done:
        log.debug("mallopt refused one of %s", settings)
    return done


def return_large_frees_to_os(threshold_bytes: int = LARGE_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold_bytes`; False where libc is not glibc."""
    return _mallopt((M_MMAP_THRESHOLD, threshold_bytes))


def reuse_freed_memory() -> bool:
    """Until `release_freed_memory`: every allocation comes from the heap, and what is freed stays
    there, resident, for the next allocation (no mmap, no trim). Call it as a sync begins.
    False where libc is not glibc."""
    return _mallopt((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM))


def release_freed_memory() -> bool:
    """Give every free heap page back to the OS and return large allocations to mmap, as
    `return_large_frees_to_os` set them (glibc's default trim threshold and mmap count). Call it
    once a sync has ended, on every path. False where libc is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    restored = _mallopt((M_MMAP_MAX, DEFAULT_MMAP_MAX), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD))
    libc.malloc_trim(0)
    return restored
