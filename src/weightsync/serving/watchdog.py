"""A watchdog process beside `weightsync serve`: when the server dies without cleaning up
(SIGKILL, the OOM killer), it ends what the server started and removes what they left.

A server cleans up after itself on every way out it sees (serving/footprint.py). SIGKILL gives
it none, and vLLM's engine core and worker are its grandchildren, in no process group or
session of their own that a killer would know to end: they lived on, holding their shared
memory (and, on a GPU host, the GPU). A parent-death signal set in those processes would not
do: it fires when the *thread* that started the process ends, and vLLM starts its engine core
from a thread that ends once the engine is built.

So the server starts this watchdog (`start`) before its engine. The watchdog waits on the
server's pid (a pidfd: woken the moment it is gone) and meanwhile notes, every `SNAPSHOT_S`,
the processes under it (each with its start time, so a reused pid is never mistaken for one)
and the engine's /dev/shm segments they map. Once the server is gone, it SIGKILLs every noted
process still running and what each started since, then removes the segments and the
server's private folder (`footprint.reap`: its manifest and vLLM's all-reduce segments), and
exits. After a clean stop there is nothing left, and the server's own cleanup has already
ended the watchdog (it is one of its descendants).

It runs as a script by path, importing only the standard library, psutil and its sibling
footprint.py: `import weightsync` (torch) would take 13 s and 230 MB on a busy 2-core host.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil

__all__ = ["SNAPSHOT_S", "start", "watch"]

SNAPSHOT_S = 1.0
"""Seconds between two looks at the server's process tree and the segments it maps."""

END_WAIT_S = 10.0
"""Seconds the watchdog waits for the processes it killed to end, before it removes segments."""


def start(folder: Path) -> subprocess.Popen[bytes]:
    """Start the watchdog of this process, whose private folder (serving/footprint.py) is
    `folder`. It stays in this process's group and session, so whatever ends a group ends it.
    Isolated (-I): it reads no PYTHON* variable and puts no folder of ours on its path."""
    return subprocess.Popen(
        [sys.executable, "-I", __file__, str(os.getpid()), str(folder)],
        # none of the server's pipes: whoever reads the server's output to its end (a parent
        # waiting for EOF) must not wait on the watchdog, which outlives a killed server
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def watch(pid: int, folder: Path) -> list[str]:
    """Wait for process `pid` to end, noting its tree meanwhile; then end what is left of the
    tree and remove its shared memory and `folder`'s. Returns the /dev/shm names removed."""
    footprint = _footprint()
    tree: dict[int, psutil.Process] = {}
    segments: set[str] = set()
    with _pidfd(pid) as gone:
        while not select.select([gone], [], [], SNAPSHOT_S)[0]:
            segments |= _note(pid, tree, footprint)
    left = _still_running(tree)
    for process in left:
        segments |= footprint._mapped_segments(process.pid)
    # the server's own end of the resource tracker's pipe closed with it: the tracker cleans up
    # once the others are gone, if it is given the chance (footprint.end_processes)
    footprint.end_processes(left, END_WAIT_S)
    removed: list[str] = footprint.reap(pid, str(folder.parent))
    return removed + footprint.unlink(segments)


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int]:
    """A pidfd for `pid`: readable once the process has ended."""
    fd = os.pidfd_open(pid)
    try:
        yield fd
    finally:
        os.close(fd)


def _note(pid: int, tree: dict[int, psutil.Process], footprint: ModuleType) -> set[str]:
    """Add the processes under `pid` now to `tree`; returns the engine segments they and `pid`
    itself map."""
    try:
        found = psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # it just ended: the next select says so
        return set()
    segments: set[str] = footprint._mapped_segments(pid)
    for process in found:
        if process.pid == os.getpid():
            continue
        tree.setdefault(process.pid, process)
        segments |= footprint._mapped_segments(process.pid)
    return segments


def _still_running(tree: dict[int, psutil.Process]) -> list[psutil.Process]:
    """The noted processes still running (the same processes: psutil checks their start
    times), and every process each started since."""
    left: dict[int, psutil.Process] = {}
    for process in tree.values():
        with contextlib.suppress(psutil.Error):
            if process.is_running():
                left[process.pid] = process
                left.update((child.pid, child) for child in process.children(recursive=True))
    left.pop(os.getpid(), None)
    return list(left.values())


def _footprint() -> ModuleType:
    """serving/footprint.py: through its package when this module was imported, else (run as a
    script, `start`) as this file's sibling, without importing the weightsync package."""
    if __package__:
        from weightsync.serving import footprint

        return footprint
    spec = importlib.util.spec_from_file_location("weightsync_footprint", Path(__file__).with_name("footprint.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load footprint.py beside {__file__}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    """`watchdog.py PID FOLDER`: watch server PID, whose private folder is FOLDER."""
    # A terminal's Ctrl-C, or SIGTERM to the server's group, is for the server: it stops cleanly
    # and its cleanup ends this process. The watchdog goes on watching until then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):  # the server ended before we looked: nothing noted
        watch(int(argv[1]), Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
