"""`weightsync serve`, however it is stopped (SIGTERM, SIGINT, its parent killed), leaves nothing
of what it or its engine made on the host: no process, no /dev/shm segment, nothing in the
temporary folder (vLLM's sockets and rendezvous file, the doorbell's folder, the server's own).

/dev/shm and the temporary folder are compared as sets before and after, restricted to what the
server's processes made (tests/leftovers.py): another run on the host is never counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ENGINES, WAIT_S, wait_until
from tests.leftovers import Footprints, tree

SRC = str(Path(__file__).resolve().parents[2] / "src")

START_S = 300.0
"""vLLM's server on a busy 2-core host (the hf one starts in seconds)."""

GONE_S = 15.0
"""A stopped server's exit: requests in flight, vLLM's own shutdown (at most 3 s), the rest."""

ENV = {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def serve_command(model: Path, engine: str) -> list[str]:
    return [sys.executable, "-m", "weightsync", "serve", "--engine", engine, "--model", str(model), "--port", "0"]


def started(process: subprocess.Popen[str]) -> None:
    line = process.stdout.readline() if process.stdout else ""  # the announcement, once it is up
    assert line.startswith("weightsync serve: http://"), line


def running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_stopped_server_leaves_nothing(tiny_models: dict[str, Path], engine: str, signum: int) -> None:
    footprints = Footprints()
    server = subprocess.Popen(
        serve_command(tiny_models["qwen2"], engine),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | ENV,
        start_new_session=True,  # the signal reaches the server alone, not a group it shares
    )
    try:
        started(server)
        footprints.during(server.pid)
        processes = tree(server.pid)
        server.send_signal(signum)
        _, stderr = server.communicate(timeout=GONE_S)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate()
    assert server.returncode == (0 if signum == signal.SIGTERM else 130), stderr
    assert wait_until(lambda: not running(processes), timeout=WAIT_S), running(processes)
    assert footprints.left() == (set(), set()), (footprints.shm, footprints.tmp)
    if engine == "vllm":  # it did make things: the check above had something to check
        assert footprints.shm and footprints.tmp, (footprints.shm, footprints.tmp)


PARENT = textwrap.dedent(
    """
    import sys, time
    from weightsync.server.process import ChildProcess
    child = ChildProcess(sys.argv[1:])
    print(child.pid, child.wait_for_line("weightsync serve: http://", {start}) is not None, flush=True)
    time.sleep(3600)
    """
)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_server_whose_parent_is_killed_leaves_nothing(tiny_models: dict[str, Path], engine: str) -> None:
    """The parent (SIGKILL) cannot stop or reap the server: the server stops itself and cleans up."""
    footprints = Footprints()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(start=START_S), *serve_command(tiny_models["qwen2"], engine)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | ENV,
    )
    try:
        pid, up = (parent.stdout.readline() if parent.stdout else "").split()
        assert up == "True"
        footprints.during(int(pid))
        processes = tree(int(pid))
        parent.kill()
        parent.communicate(timeout=WAIT_S)
        killed = time.monotonic()
        assert wait_until(lambda: not running(processes), timeout=GONE_S), running(processes)
        gone = time.monotonic() - killed
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
    assert footprints.left() == (set(), set()), (footprints.shm, footprints.tmp, f"gone {gone:.1f} s after")
