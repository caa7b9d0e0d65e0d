"""The README's Ray program ("A fleet on Ray"), run as written in a process of its own: a local
Ray cluster, two rollout servers as actors, three pushes, each served by both servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_snippets import ROOT, write_program
from tests.models import save_model

pytest.importorskip("ray")

pytestmark = pytest.mark.slow


def test_the_readme_ray_program_runs_as_written(tmp_path: Path) -> None:
    program = write_program("README.md", "## A fleet on Ray", tmp_path / "fleet.py")
    model = tmp_path / "qwen2"
    save_model("qwen2", model)
    env = {"PYTHONPATH": str(ROOT / "src"), "RAY_USAGE_STATS_ENABLED": "0"}  # no prompt, no report home
    done = subprocess.run(
        [sys.executable, str(program), str(model)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | env,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    lines = done.stdout.splitlines()
    summaries = [line for line in lines if " committed on " in line]
    assert [line.split(" committed on ")[0] for line in summaries] == ["version 1", "version 2", "version 3"], lines
    served = [line.split() for line in lines if line.startswith("http://")]
    assert sorted(int(version) for _, version in served) == [1, 1, 2, 2, 3, 3], lines
