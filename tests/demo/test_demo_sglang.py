"""`weightsync demo --engine sglang`, as a user runs it from SGLang's venv (scripts/install-sglang.sh):
a short run on one real SGLang server syncs every step and writes its summary. (Whether the
default run learns is measured, not tested: benchmarks/results/demo_sglang_*.)

Skipped where SGLang's venv is absent (WEIGHTSYNC_SKIP_SGLANG=1 skips installing it).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from weightsync_bench.sglang_server import sglang_venv

VENV = sglang_venv()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.skipif(VENV is None, reason="SGLang's venv is absent (scripts/install-sglang.sh makes it)"),
]

RUN_S = 900
"""An SGLang start (a minute or more on a busy 2-core host) and three small steps."""


def test_a_short_demo_on_an_sglang_server_syncs_every_step(tmp_path: Path) -> None:
    assert VENV is not None
    out = tmp_path / "run"
    command = [str(VENV / "bin" / "python"), "-m", "weightsync", "demo", "--engine", "sglang", "--servers", "1"]
    command += ["--steps", "3", "--prompts-per-step", "4", "--group", "4", "--out", str(out), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "sglang" and summary["mode"] == "disaggregated"
    assert summary["steps"] == 3 and summary["syncs"] >= 3
    assert summary["dropped_stale"] == 0
    assert "sglang engine" in done.stdout + done.stderr
