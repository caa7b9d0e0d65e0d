"""Child `weightsync` processes (the demo's rollout servers) that never outlive their parent.

However the parent ends (it returns, crashes, is sent SIGTERM or SIGINT, or is killed with
SIGKILL), no child is left behind:

- the parent stops its children itself on every way out it sees (`ChildProcess.close`);
- for the ways it cannot see (SIGKILL, an interpreter crash), each child holds the read end of a
  pipe whose only write end is the parent's (its number is in $WEIGHTSYNC_PARENT_FD). When the
  parent is gone, the kernel closes that end, the child reads EOF and stops itself
  (`exit_with_parent`, armed by the `weightsync` command);
- each child runs in its own session, so a terminal's Ctrl-C reaches the parent only, which
  then stops its children quietly instead of every process printing its own interruption;
- its session is also its process group, and everything the child starts stays in it (vLLM's
  engine core and worker processes, for one): a child that has to be killed, or exits on its own
  but leaves processes behind, is swept as a group, so none of its descendants outlives it;
- a `weightsync serve` child removes what it and its engine made on the host as it stops
  (serving/footprint.py); one that had to be killed cannot, so `close` reaps what it left.

Linux's PR_SET_PDEATHSIG would not do: it fires when the *thread* that forked the child exits,
not the process, and parents start children from pool threads.

A child announces itself on stdout (`weightsync serve` prints its URL): `wait_for_line` reads
that line with a deadline, and a reader thread keeps draining the pipe after it so the child
never blocks on a full pipe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from weightsync.serving import footprint

__all__ = ["PARENT_FD_ENV", "PARENT_GONE_GRACE_S", "ChildProcess", "exit_with_parent", "on_hard_exit", "quiet_children"]

log = logging.getLogger(__name__)

PARENT_FD_ENV = "WEIGHTSYNC_PARENT_FD"
"""The pipe end a child watches for its parent's death (set by `ChildProcess`)."""

PARENT_GONE_GRACE_S = 5.0
"""Seconds a child whose parent died has to stop cleanly after SIGTERM before it exits anyway."""

STOP_TIMEOUT_S = 10.0
"""Seconds `ChildProcess.close` waits for the child to stop, before SIGKILL."""

STDOUT_CLOSED_EXIT_S = 5.0
"""Seconds a child whose stdout closed gets to exit, so that a caller polling `alive()` sees it end."""

TAIL_LINES = 20
"""Lines of a child's stderr kept for `ChildProcess.tail` (why it did not start, say)."""


class ChildProcess:
    """`command` (a `weightsync` command line) in a child process tied to this one.

    Args:
        command: the argv to run.
        env: its environment (default: this process's).
        log_path: a file for the child's stderr (its log), instead of this process's stderr: an
            engine's start-up noise stays out of the user's terminal, and is there to read.
    """

    def __init__(self, command: list[str], env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        read_fd, self._lifeline = os.pipe()  # both ends non-inheritable: only the child gets read_fd
        try:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=(os.environ if env is None else env) | {PARENT_FD_ENV: str(read_fd)},
                pass_fds=(read_fd,),
                start_new_session=True,
            )
        except BaseException:
            os.close(self._lifeline)
            raise
        finally:
            os.close(read_fd)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log_path = log_path
        self._log = None if log_path is None else log_path.open("a", encoding="utf-8")
        self._found = threading.Event()
        self._quiet = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True, name="weightsync-child-stdout")
        self._reader.start()
        self._relay = threading.Thread(target=self._relay_stderr, daemon=True, name="weightsync-child-stderr")
        self._relay.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_for_line(self, prefix: str, timeout: float) -> str | None:
        """The first stdout line starting with `prefix`, or None if none comes within `timeout`
        seconds or the process exits first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                self._lines.put(None)  # later calls see the end too
                with contextlib.suppress(subprocess.TimeoutExpired):  # its stdout closed: it is exiting
                    self.process.wait(min(left, STDOUT_CLOSED_EXIT_S))
                return None
            if line.startswith(prefix):
                self._found.set()
                return line
        return None

    def tail(self) -> list[str]:
        """The last lines the child wrote to stderr (up to `TAIL_LINES`), blank ones left out."""
        return [line for line in list(self._tail) if line.strip()]

    def why_not_started(self, what: str, timeout: float, flag: str = "") -> str:
        """Why no announcement came, on one line: the wait that ran out (and `flag`, that gives a
        longer one) or the child's exit status, then where its log is and how it ends."""
        status = self.process.poll()
        if status is None:
            longer = f" ({flag} SECONDS waits longer)" if flag else ""
            head = f"{what} did not start within {timeout:.0f} s{longer}"
        else:
            head = f"{what} exited with status {status} before it started"
        where = "its log" if self.log_path is None else f"its log {self.log_path}"
        last = " | ".join(line.strip() for line in self.tail()[-3:])
        return f"{head}; {where} ends: {last}" if last else f"{head}; {where} is empty"

    def kill(self) -> None:
        """SIGKILL to the child and everything it started (its process group), then reap. Called
        while the child is alive or unreaped, so the group id is still the child's own."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Ask the child to stop (SIGTERM), without waiting. Its lifeline stays open until `close`:
        a child told to stop by a living parent gets its whole `STOP_TIMEOUT_S` to shut down (vLLM's
        engine takes seconds), not the short grace of a child whose parent died."""
        self._quiet.set()
        if self.alive():
            self.process.terminate()

    def close(self) -> None:
        """Stop the child and reap it (SIGKILL to its group if it is still there after
        `STOP_TIMEOUT_S`); then sweep its group, and return once all it started has ended."""
        self.stop()
        if not self._exited_within(STOP_TIMEOUT_S):
            log.warning("pid %d did not stop within %.0f s: killing its process group", self.pid, STOP_TIMEOUT_S)
        members = self._group_members()  # while the child's group id is still its own
        self.kill()
        self._wait_ended(members, STOP_TIMEOUT_S)
        footprint.reap(self.pid)  # what a server killed before it could clean up left behind
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        # Every writer of the stdout pipe is gone now: the reader sees EOF and closes it. Closing it
        # here instead would block on the reader's lock while a writer lived on.
        self._reader.join(STOP_TIMEOUT_S)
        self._relay.join(STOP_TIMEOUT_S)
        if self._reader.is_alive() or self._relay.is_alive():
            log.warning("pid %d: its stdout is still open in another process; leaving it", self.pid)

    def _exited_within(self, timeout: float) -> bool:
        """Whether the child exits within `timeout`, leaving it unreaped (a zombie keeps its
        process group id reserved for `kill`)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # already reaped (by `alive()`)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _group_members(self) -> list[psutil.Process]:
        """The processes in the child's group (its session) now: the child and all it started."""
        members = []
        for process in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getpgid(process.pid) == self.pid:
                    members.append(process)
        return members

    @staticmethod
    def _wait_ended(processes: list[psutil.Process], timeout: float) -> None:
        """Wait until each of `processes` has ended (gone, or a zombie nobody reaped yet): SIGKILL is
        delivered asynchronously, and a loaded host can take a moment to end what it reached."""
        deadline = time.monotonic() + timeout
        for process in processes:
            while time.monotonic() < deadline:
                try:
                    if process.status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.02)
            else:
                log.warning("pid %d still runs %.0f s after SIGKILL to its group", process.pid, timeout)
                return

    def _relay_stderr(self) -> None:
        """The child's stderr into its log file, or onto ours line by line until it is told to
        stop (or this process is stopping: `quiet_children`): what it says while it shuts down
        is not news. The last lines are kept for `tail` either way."""
        stderr = self.process.stderr
        try:
            for line in stderr or ():
                self._tail.append(line)
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()
                elif not (self._quiet.is_set() or _QUIET.is_set()):
                    sys.stderr.write(line)
                    sys.stderr.flush()
        except (OSError, ValueError):
            pass
        finally:
            if stderr is not None:
                stderr.close()
            if self._log is not None:
                self._log.close()

    def _read(self) -> None:
        stdout = self.process.stdout
        try:
            for line in stdout or ():
                if not self._found.is_set():  # after the announcement, only drain
                    self._lines.put(line)
        except (OSError, ValueError):
            pass
        finally:
            if stdout is not None:
                stdout.close()
        self._lines.put(None)


_QUIET = threading.Event()


def quiet_children() -> None:
    """This process is stopping (SIGTERM, Ctrl-C): its children's stderr is no longer shown, so
    that the stop prints one line (a sync the stop aborted, say, is not news)."""
    _QUIET.set()


_HARD_EXIT: list[Callable[[], object]] = []


def on_hard_exit(callback: Callable[[], object]) -> None:
    """Run `callback` before this process ends itself hard (`exit_with_parent`: the parent died and
    this process did not stop within its grace); a server removes what it made there."""
    _HARD_EXIT.append(callback)


def exit_with_parent(fd: int, grace_s: float = PARENT_GONE_GRACE_S) -> None:
    """Stop this process once the parent that holds the other end of pipe `fd` is gone: SIGTERM
    to ourselves (a server shuts down cleanly), then a hard exit `grace_s` seconds later (after
    the `on_hard_exit` callbacks)."""

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        log.info("the parent process is gone (its pipe closed): stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.warning("not stopped %.0f s after the parent died: killing this process group", grace_s)
        for callback in _HARD_EXIT:
            try:
                callback()
            except Exception as exc:  # the exit goes on: it is the last resort
                log.warning("cleaning up before the hard exit failed: %s", exc)
        with contextlib.suppress(OSError):  # our own group (ChildProcess gave us a session): no orphans
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="weightsync-parent-watch").start()
