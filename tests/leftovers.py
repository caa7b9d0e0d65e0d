"""What a run of `weightsync serve` or `weightsync demo` made on the host, and what it left there.

`Footprints` snapshots /dev/shm and the temporary folder before a run; `during(tree)` records,
while the run's processes live, the entries they made (new names that some process of the
tree maps or holds, so that another run on the host is not counted as ours);
`left()` is what of those is still there after the stop. In the temporary folder, a run's own
entries are the new names its processes hold open (files, Unix sockets) or that are named as
weightsync and vLLM name theirs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")


def entries() -> tuple[set[str], set[str]]:
    """Names in /dev/shm and in the temporary folder now."""
    return set(os.listdir(SHM_DIR)), set(os.listdir(tempfile.gettempdir()))


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return []


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie is not)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def mapped(pids: list[int]) -> set[str]:
    """/dev/shm names the processes `pids` map (unlinked ones left out)."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.partition(" /dev/shm/")[2].rstrip("\n")
                    if path and not path.endswith(" (deleted)"):
                        names.add(path)
        except OSError:
            pass
    return names


def held(pids: list[int]) -> set[str]:
    """Paths the processes `pids` hold open: files, and the Unix sockets they bound or reach."""
    inodes, paths = set(), set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
                    else:
                        paths.add(target)
        except OSError:
            pass
    with contextlib.suppress(OSError), open("/proc/net/unix") as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes:
                paths.add(fields[7])
    return paths


OURS = re.compile(r"weightsync-.*|vllm_dist_.*")
"""Temporary folder names a server or vLLM makes without holding them open (vLLM's rendezvous file)."""


class Footprints:
    """Snapshot now (before the run starts)."""

    def __init__(self) -> None:
        self.shm_before, self.tmp_before = entries()
        self.shm: set[str] = set()
        self.tmp: set[str] = set()

    def during(self, pid: int) -> None:
        """Record what the run of process `pid` has made so far (call while it runs)."""
        shm, tmp = entries()
        self.shm |= (shm - self.shm_before) & mapped(tree(pid))
        # vLLM's all-reduce segments, named after its rendezvous file (made by the same run)
        rendezvous = {name for name in tmp - self.tmp_before if name.startswith("vllm_dist_")}
        self.shm |= {name for name in shm - self.shm_before if name.partition("-")[0] in rendezvous}
        root = Path(tempfile.gettempdir())
        held_here = {
            Path(path).relative_to(root).parts[0] for path in held(tree(pid)) if Path(path).is_relative_to(root)
        }
        self.tmp |= {name for name in tmp - self.tmp_before if name in held_here or OURS.fullmatch(name)}

    def left(self) -> tuple[set[str], set[str]]:
        """What the run made that is still there: (/dev/shm names, temporary folder names)."""
        shm, tmp = entries()
        return self.shm & shm, self.tmp & tmp

    def remove(self) -> None:
        """Remove what `left` finds: for an engine that leaves its segments behind when it stops
        (stock vLLM's message queues and CPU all-reduce), nothing another run made."""
        shm, tmp = self.left()
        for name in shm:
            (SHM_DIR / name).unlink(missing_ok=True)
        for name in tmp:
            path = Path(tempfile.gettempdir()) / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
