"""The scripts in benchmarks/ keep working as the package changes under them.

`bench_server.py` once imported a helper that had been renamed, and nothing noticed until it
was run again: every script is now at least started here, and the server benchmark runs whole
at a tiny size (it drives `weightsync serve` as a user would).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(path.name for path in (ROOT / "benchmarks").glob("bench_*.py"))
ENV = os.environ | {"PYTHONPATH": str(ROOT / "src")}


def test_there_are_benchmark_scripts_to_check():
    assert "bench_server.py" in SCRIPTS and len(SCRIPTS) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_imports_and_explains_itself(script):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage:")


@pytest.mark.slow
def test_the_server_benchmark_runs_whole_and_reports_the_servers_breakdown(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--engine", "hf"]
    command += ["--size-gb", "0.005", "--model-dir", str(tmp_path), "--timeout", "120", "--warm-cache", "--json"]
    run = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    times = result["dummy"]["next_push_receiver_times"]
    assert set(times) == {"total_s", "transfer_s", "landing_s", "load_s", "pause_s"}
    assert times["total_s"] > 0 and times["total_s"] >= times["landing_s"]
    assert result["dummy"]["weight_bytes"] > 0
    assert "server's breakdown: total" in run.stderr
