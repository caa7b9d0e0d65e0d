"""`weightsync demo` as a process: however it ends, its rollout servers end with it, and nothing
they made stays on the host (no /dev/shm segment, nothing in the temporary folder).

The signal goes to the demo process alone, not to its process group (a terminal's Ctrl-C
reaches the whole group, which hid the bug: servers outlived a demo sent SIGTERM)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import psutil
import pytest

from tests.helpers import ENGINES, wait_until
from tests.leftovers import Footprints, tree

SRC = str(Path(__file__).resolve().parents[2] / "src")

START_S = 180.0
"""The demo's start-up: imports and two hf servers, on a busy 2-core host."""

GONE_S = 10.0

EXIT_S = 40.0
"""The demo's own exit once signalled: its servers stop first (within GONE_S), then it plots and
sums up the steps it did (matplotlib's import, slow on a busy 2-core host)."""


def start_demo(out: Path, engine: str = "hf", stderr: int | IO[str] = subprocess.PIPE) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "weightsync", "demo", "--engine", engine, "--steps", "10000", "--out", str(out)]
    command += ["--timeout", str(START_S)]  # the servers' start-up on a loaded host (vLLM's: a minute or more)
    return subprocess.Popen(
        [*command, "--no-progress", "--prompts-per-step", "2", "--group", "2"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=os.environ | {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"},
        preexec_fn=default_sigint,
    )


def default_sigint() -> None:
    """Run by the child before Python starts: a shell's background job (`cmd &`, as CI may be
    started) ignores SIGINT, and a Python started so never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def training(out: Path, steps: int = 1) -> bool:
    done = out / "steps.jsonl"
    return done.is_file() and done.read_text().count("\n") >= steps


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(pid: int) -> bool:
    try:
        return running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.fault(
    "parent killed: the demo (parent of two `weightsync serve` processes) is signalled alone, mid-run",
    expected="no server left within 10 s: on SIGTERM/SIGINT the demo stops them and exits quietly (143/130); "
    "on SIGKILL each server sees its parent's pipe close and stops itself",
)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["term", "int", "kill"])
def test_killing_the_demo_alone_leaves_no_server(tmp_path, signum, observe) -> None:
    demo = start_demo(tmp_path)
    try:
        assert wait_until(lambda: training(tmp_path) or demo.poll() is not None, timeout=START_S)
        assert demo.poll() is None, demo.communicate()[1]
        servers = psutil.Process(demo.pid).children()
        assert len(servers) == 2, servers
        killed = time.monotonic()
        demo.send_signal(signum)
        gone = wait_until(lambda: not any(running(s) for s in servers), timeout=GONE_S)
        seconds = time.monotonic() - killed
        _, stderr = demo.communicate(timeout=EXIT_S)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert gone, f"servers still running {GONE_S} s after {signum.name}: {[s.pid for s in servers if running(s)]}"
    assert "Traceback" not in stderr, stderr
    expected = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -signal.SIGKILL}[signum]
    assert demo.returncode == expected, (demo.returncode, stderr)
    if signum != signal.SIGKILL:
        assert stderr.strip().splitlines()[-1:] == [
            "weightsync demo: " + ("terminated" if signum == signal.SIGTERM else "interrupted")
        ], stderr
        summary = json.loads((tmp_path / "summary.json").read_text())  # the steps done, plotted and summed up
        assert summary["interrupted"] is True and summary["steps"] >= 1, summary
        assert (tmp_path / "reward_and_sync.png").stat().st_size > 0
    observe(f"{signum.name}: both servers gone {seconds:.1f} s after the signal; demo exit status {demo.returncode}")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_sigterm_at_a_random_step_leaves_nothing_and_prints_one_line(tmp_path: Path, engine: str) -> None:
    """No process, nothing new in /dev/shm or the temporary folder (of what the demo's processes
    made), and one line on stderr after the signal."""
    step = random.randint(1, 5)
    footprints = Footprints()
    with open(tmp_path / "stderr", "w+") as stderr:
        demo = start_demo(tmp_path / "run", engine, stderr)
        try:
            assert wait_until(lambda: training(tmp_path / "run", step) or demo.poll() is not None, timeout=START_S)
            assert demo.poll() is None, (tmp_path / "stderr").read_text()
            footprints.during(demo.pid)
            processes = tree(demo.pid)
            said = os.fstat(stderr.fileno()).st_size  # what it printed before the signal
            demo.send_signal(signal.SIGTERM)
            demo.communicate(timeout=EXIT_S)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.communicate()
    after = (tmp_path / "stderr").read_bytes()[said:].decode().splitlines()
    assert demo.returncode == 143, after
    assert after == ["weightsync demo: terminated"], after
    assert wait_until(lambda: not any(alive(pid) for pid in processes)), [pid for pid in processes if alive(pid)]
    assert footprints.left() == (set(), set()), (step, footprints.shm, footprints.tmp)
