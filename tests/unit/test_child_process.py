"""`ChildProcess`: stopping a child leaves nothing it started behind, and never hangs on a pipe
that a grandchild still holds (vLLM's engine core inherits the server's stdout)."""

from __future__ import annotations

import sys
import threading
import time

import psutil
import pytest

from weightsync.serving.process import STOP_TIMEOUT_S, ChildProcess

# A child that starts a grandchild holding its stdout, announces both, and then either exits on
# SIGTERM (leaving the grandchild behind, as a server killed mid-shutdown would) or ignores it.
CHILD = r"""
import signal, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("READY", grandchild.pid, flush=True)
time.sleep(300)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("on_sigterm", ["exit", "ignore"])
def test_close_sweeps_what_the_child_started_and_returns(on_sigterm: str) -> None:
    child = ChildProcess([sys.executable, "-c", CHILD, on_sigterm])
    line = child.wait_for_line("READY", 60)
    assert line is not None, child.why_not_started("the test child", 60)
    grandchild = int(line.split()[1])
    assert not gone(grandchild)

    closing = threading.Thread(target=child.close, daemon=True)
    started = time.monotonic()
    closing.start()
    closing.join(STOP_TIMEOUT_S + 20)
    assert not closing.is_alive(), "close() hung on the stdout pipe the grandchild holds"
    assert not child.alive() and gone(grandchild)
    if on_sigterm == "exit":
        assert time.monotonic() - started < STOP_TIMEOUT_S, "a child that stops is not waited for in full"
