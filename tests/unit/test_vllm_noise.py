"""Keeping Triton out where it cannot run: in the process that asks, and in every process that
has the quiet site folder on its PYTHONPATH (as vLLM's spawned engine core and workers do), with
another sitecustomize on the path still run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from weightsync.serving.vllm.noise import QUIET_SITE

SRC = str(Path(__file__).resolve().parents[2] / "src")


def python(code: str, *path: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([*path, SRC])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_a_process_kept_from_triton_cannot_import_it_and_logs_nothing_of_it() -> None:
    done = python(
        "import importlib.util, logging, sys\n"
        "from weightsync.serving.vllm.quiet_site.sitecustomize import TRITON_NOTES, keep_triton_out\n"
        "keep_triton_out()\n"
        "assert importlib.util.find_spec('triton') is None\n"
        "try:\n    import triton\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('imported')\n"
        "for name, start in TRITON_NOTES.items():\n    logging.getLogger(name).warning(start + ', and more')\n"
        "logging.getLogger('vllm.platforms.cpu').warning('another note')\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "another note", done.stderr  # only the notes about Triton are dropped


def test_a_process_with_the_quiet_site_on_its_path_keeps_triton_out_and_runs_the_hidden_one(tmp_path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.HIDDEN_RAN = True\n")
    check = "import builtins, sys; print(sys.modules.get('triton', 'absent'), getattr(builtins, 'HIDDEN_RAN', False))"
    assert python(check, str(QUIET_SITE), str(tmp_path)).stdout.split() == ["None", "True"]
    assert python(check, str(tmp_path)).stdout.split() == ["absent", "True"]
