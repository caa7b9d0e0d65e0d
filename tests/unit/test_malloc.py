"""`weightsync.integrations.vllm.malloc`: during a sync, freed memory is reused without page faults; after
it, the free pages go back to the OS. The settings are process-wide, so each case runs in a child
process, as a vLLM worker holds them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A layer-sized temporary, allocated, written and freed a few times (as a reload does layer after
# layer), through glibc's own malloc: the page faults of the later rounds, and the RSS once the
# window is released.
CHILD = textwrap.dedent(
    """
    import ctypes, json, resource
    import psutil
    from weightsync.integrations.vllm import malloc

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def rounds(count=3, nbytes=48 << 20):
        before = faults()
        for _ in range(count):
            block = libc.malloc(nbytes)
            ctypes.memset(block, 1, nbytes)
            libc.free(block)
        return faults() - before

    malloc.return_large_frees_to_os()
    rounds(1)
    outside = rounds()
    window = malloc.reuse_freed_memory()
    rounds(1)  # the first allocation faults its pages in once
    inside = rounds()
    rss_held = psutil.Process().memory_info().rss
    released = malloc.release_freed_memory()
    rss_released = psutil.Process().memory_info().rss
    after = rounds()
    print(json.dumps({"window": window, "released": released, "outside": outside, "inside": inside,
                      "after": after, "rss_drop": rss_held - rss_released}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_sync_window_reuses_freed_memory_and_gives_it_back_after() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env={"PYTHONPATH": SRC}
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["window"] and found["released"]
    pages = (3 * 48 << 20) // 4096
    assert found["outside"] > pages // 2  # mmap'd afresh each time: every page faulted in
    assert found["inside"] < pages // 20  # the heap's freed pages, reused resident
    assert found["rss_drop"] >= 40 << 20  # the free heap pages went back to the OS
    assert found["after"] > pages // 2  # large blocks come from mmap again
