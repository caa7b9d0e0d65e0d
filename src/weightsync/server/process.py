"""Child processes that announce themselves on stdout (`weightsync serve` prints its URL): read
that line with a deadline, and keep draining the pipe after it so the child never blocks."""

from __future__ import annotations

import queue
import subprocess
import threading
import time

__all__ = ["first_line_with"]


def first_line_with(process: subprocess.Popen[str], prefix: str, timeout: float) -> str | None:
    """The first stdout line of `process` starting with `prefix`, or None if none comes within
    `timeout` s or the process exits. The reader thread keeps draining stdout afterwards (engines
    may log there), so the pipe never fills."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        found = False
        try:
            for line in process.stdout:  # type: ignore[union-attr]
                if not found:  # after our line, only drain
                    lines.put(line)
                    found = line.startswith(prefix)
        except (OSError, ValueError):  # stdout closed by `close()` while we read: we are done
            pass
        lines.put(None)

    threading.Thread(target=read, daemon=True, name="weightsync-child-stdout").start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith(prefix):
            return line
    return None
