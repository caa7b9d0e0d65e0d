"""What a `weightsync serve` process and the engine it starts leave on the host, and its removal.

The server process owns cleanup of everything it or its engine makes (vLLM's engine core and
workers, and the resource tracker Python's multiprocessing starts for them):

- **Temporary files and sockets** go to a private folder, `<tmp>/weightsync-serve-<pid>-<random>`
  (mode 0700): it becomes this process's `tempfile.tempdir` and its children's `$TMPDIR`, so
  vLLM's ZMQ sockets, its `vllm_dist_<id>` rendezvous file and the doorbell's folder land there.
  Stopping removes the folder whole.
- **Shared memory** in /dev/shm is named by whoever creates it, so it is found by what this
  process tree maps (`/proc/<pid>/maps`): segments named as vLLM and Python's multiprocessing
  name them (`psm_*`, `sem.mp-*`, `vllm_dist_*`; SGLang's `sglang_*.shm`), seen mapped by this
  process or a descendant (`note`, called while the engine loads, once it is up, every few
  seconds while it serves, and as it stops). vLLM's CPU all-reduce names
  its segments after the rendezvous file (`/dev/shm/vllm_dist_<id>-...`), and that file lies in
  the private folder: those are found even if no process still maps them.
  Nothing another run made is touched: a name must be one this tree mapped, or carry the id of
  a rendezvous file in this server's own folder.
- **Processes**: the server is a child subreaper (PR_SET_CHILD_SUBREAPER), so a vLLM worker
  whose engine core died stays its descendant. `close`, called once the engine has had its own
  shutdown, ends every descendant still there (SIGKILL) before it removes anything, so no
  process of ours maps a segment it unlinks.

Each name noted is also written to a manifest in the folder, so that a server killed before
it could clean up (SIGKILL to its process group) is cleaned up by whoever finds it dead:
`reap(pid)` (its parent, `ChildProcess.close`) or `reap_dead()` (the next server on the host).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

__all__ = ["FOLDER_PREFIX", "Footprint", "end_processes", "reap", "reap_dead", "unlink"]

log = logging.getLogger(__name__)

FOLDER_PREFIX = "weightsync-serve-"
"""A server's private temporary folder: `<tmp>/weightsync-serve-<pid>-<random>`."""

SHM_DIR = Path("/dev/shm")
MANIFEST = "shared-memory"
"""The file in the folder listing the /dev/shm names the server's processes were seen mapping."""

ENGINE_SEGMENT = re.compile(r"psm_[0-9a-f]+|sem\.mp-[a-z0-9_]+|vllm_dist_[0-9a-f]{32}-.+|sglang_[a-z]+_[0-9a-f_]+\.shm")
"""/dev/shm names made by an engine's processes: Python's multiprocessing (shared_memory,
semaphores), vLLM's CPU all-reduce (`vllm_dist_<id>-<group>-cpushm_<rank>`) and SGLang's load
snapshots (`sglang_loads_<id>_<id>.shm`, which SGLang leaves behind even when it stops)."""

RENDEZVOUS = re.compile(r"vllm_dist_[0-9a-f]{32}")
"""vLLM's rendezvous file (`file://<tmp>/vllm_dist_<id>`): its id prefixes the all-reduce's segments."""

END_WAIT_S = 5.0
"""Seconds `close` waits for the descendants it killed to end (SIGKILL is delivered asynchronously)."""

CLOSE_WAIT_S = 5.0
"""Seconds a second `close` (the parent-death path) waits for one under way in another thread."""

_PR_SET_CHILD_SUBREAPER = 36


class Footprint:
    """This process's private temporary folder and the shared memory its process tree uses.

    Args:
        root: where the folder goes (default: the system's temporary folder).
    """

    def __init__(self, root: str | None = None) -> None:
        reap_dead(root)
        base = root or tempfile.gettempdir()
        self.folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=base))
        self.segments: set[str] = set()
        self._closing = threading.Lock()
        self._closed = False
        self._previous = (os.environ.get("TMPDIR"), tempfile.tempdir)
        os.environ["TMPDIR"] = tempfile.tempdir = str(self.folder)
        _become_subreaper()

    def note(self) -> None:
        """Record the engine's /dev/shm segments this process and its descendants map now."""
        found = set()
        for process in [psutil.Process(), *_descendants()]:
            found |= _mapped_segments(process.pid)
        new = found - self.segments
        if new:
            self.segments |= new
            with open(self.folder / MANIFEST, "a") as manifest:
                manifest.writelines(f"{name}\n" for name in sorted(new))

    def close(self) -> list[str]:
        """End every descendant, then remove the segments noted, the all-reduce's and the folder.
        Returns the /dev/shm names removed (none on a second call)."""
        from weightsync.transports.shm import reap_stale_segments  # numpy and more: not at CLI start

        if not self._closing.acquire(timeout=CLOSE_WAIT_S):  # another thread is closing it
            return []
        try:
            if self._closed:
                return []
            self._closed = True
            with contextlib.suppress(psutil.Error):
                self.note()
            end_descendants(self.segments)
            removed = _remove(self.folder, self.segments)
            removed += reap_stale_segments()  # weightsync's own rings, of a pid of ours now gone
            variable, tempfile.tempdir = self._previous
            if variable is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = variable
        finally:
            self._closing.release()
        if removed:
            log.info("removed %d shared-memory segments the engine left: %s", len(removed), ", ".join(removed))
        return removed

    def __enter__(self) -> Footprint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def end_descendants(segments: Iterable[str] = (), timeout: float = END_WAIT_S) -> None:
    """SIGKILL to every descendant of this process; wait up to `timeout` for them to end (reaping
    our children). Called once the engine had its own chance to stop: what is left is stuck, or
    ignores SIGTERM (Python's resource tracker does). The tracker goes last (`end_processes`),
    after our own end of its pipe is closed (`_release_resource_tracker`), forgetting `segments`
    (which the caller unlinks)."""
    end_processes(_descendants(), timeout, before_trackers=functools.partial(_release_resource_tracker, segments))


def end_processes(
    processes: list[psutil.Process], timeout: float = END_WAIT_S, before_trackers: Callable[[], None] | None = None
) -> None:
    """SIGKILL `processes`, Python's resource trackers among them last. A tracker unlinks the
    semaphores and segments still registered with it (`sem.mp-*`, `psm_*` of processes that
    were killed) once every holder of its pipe is gone, then exits: killed first, it could not,
    and they stayed in /dev/shm. `before_trackers` runs once the others have ended (the holder
    of a pipe end that is still alive closes it there); a tracker that has not exited within
    `timeout` is killed."""
    trackers = [process for process in processes if _is_resource_tracker(process)]
    _kill([process for process in processes if process not in trackers], timeout)
    if before_trackers is not None:
        before_trackers()
    _, alive = psutil.wait_procs(trackers, timeout=timeout)
    _kill(alive, timeout)


def _kill(processes: list[psutil.Process], timeout: float) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    if alive:
        log.warning("processes still running %.0f s after SIGKILL: %s", timeout, [p.pid for p in alive])


def _is_resource_tracker(process: psutil.Process) -> bool:
    """Whether `process` is Python multiprocessing's resource tracker (by its command line)."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _release_resource_tracker(segments: Iterable[str]) -> None:
    """Close this process's end of its resource tracker's pipe (the tracker's own `_stop`, but
    without its unbounded wait: `end_processes` bounds it), so that the tracker, once its other
    holders are gone, cleans up and exits. First it forgets the shared-memory segments among
    `segments` (their creators were killed before unlinking them): they are unlinked once, by the
    caller, and the tracker, finding none left, warns of no leak."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    fd = getattr(tracker, "_fd", None)
    if fd is None:
        return
    for name in sorted(segment for segment in segments if segment.startswith("psm_")):
        with contextlib.suppress(Exception):  # registered first: forgetting a name it never held would raise there
            tracker.register(f"/{name}", "shared_memory")
            tracker.unregister(f"/{name}", "shared_memory")
    with contextlib.suppress(OSError):
        os.close(fd)
    # ended (and reaped) by end_processes; a later use starts a new one (private fields: the stdlib
    # has no public way to let go of its tracker)
    setattr(tracker, "_fd", None)  # noqa: B010
    setattr(tracker, "_pid", None)  # noqa: B010


def reap(pid: int, root: str | None = None) -> list[str]:
    """Remove what server `pid` (now gone) left: its folders, the segments they name. Returns
    the /dev/shm names removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}{pid}-*"):
        try:
            noted = set((folder / MANIFEST).read_text().split())
        except OSError:  # no manifest: it mapped nothing yet
            noted = set()
        removed += _remove(folder, noted)
    return removed


def reap_dead(root: str | None = None) -> list[str]:
    """`reap` every server whose folder is here and whose process is gone."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).partition("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            removed += reap(int(pid), root)
    return removed


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _mapped_segments(pid: int) -> set[str]:
    """The engine's /dev/shm names `pid` maps (unlinked ones left out)."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.partition(" /dev/shm/")[2].rstrip("\n")
                if path and not path.endswith(" (deleted)") and ENGINE_SEGMENT.fullmatch(path):
                    names.add(path)
    except OSError:  # gone, or not ours to read
        pass
    return names


def _remove(folder: Path, segments: set[str]) -> list[str]:
    """Unlink `segments` and the all-reduce segments of the rendezvous files in `folder`, then
    remove `folder`. Returns the names unlinked."""
    names = set(segments)
    with contextlib.suppress(OSError):
        ids = {f"{entry.name}-" for entry in folder.iterdir() if RENDEZVOUS.fullmatch(entry.name)}
        if ids:
            names |= {name for name in os.listdir(SHM_DIR) if name.startswith(tuple(ids))}
    removed = unlink(names)
    shutil.rmtree(folder, ignore_errors=True)
    return removed


def unlink(names: set[str]) -> list[str]:
    """Unlink /dev/shm `names`; returns those that were there."""
    removed = []
    for name in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
            removed.append(name)
    return removed


def _become_subreaper() -> None:
    """Orphans among our descendants (a worker whose engine core died) stay ours to end."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.debug("PR_SET_CHILD_SUBREAPER failed: errno %d", ctypes.get_errno())
