"""scripts/setup.sh does not redo a set-up that is done: `./scripts/demo.sh` run a second time
goes straight to the demo (the issue's newcomer reinstalled the venv on every try)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (ROOT / ".venv" / ".weightsync-setup").is_file(), reason="no set-up by scripts/setup.sh here")
def test_a_second_setup_skips_what_the_first_did() -> None:
    started = time.monotonic()
    done = subprocess.run([str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "setup: .venv is already set up (scripts/setup.sh --force redoes it)", done.stdout
    assert time.monotonic() - started < 20, "no pip, no import"


def test_install_sglang_keeps_the_expected_resolver_errors_off_the_terminal() -> None:
    """Without a GPU, SGLang goes in without its CUDA-only requirements: pip's resolver would list
    them as missing after each install that follows (walls of ERROR lines, with no word that they
    are expected); every such install says not to."""
    script = (ROOT / "scripts" / "install-sglang.sh").read_text()
    cpu_path = script[script.index('echo "sglang [2/4] installing torch') :]
    installs = [line for line in cpu_path.splitlines() if '"${install[@]}"' in line][1:]  # [0]: torch, first
    assert len(installs) == 3 and all('"${quiet[@]}"' in line for line in installs), installs
    assert "quiet=(--no-warn-conflicts)" in cpu_path.split("\nfi\n", 1)[0]
