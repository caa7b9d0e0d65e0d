"""`weightsync serve --engine vllm`, started as a user starts it and stopped: what it prints, on
stdout and stderr, from every process of its tree (vLLM's engine core and worker too), says
nothing of Triton, which cannot run on a CPU host, nor lists the leaks of Triton's bindings at
exit (serving/vllm/noise.py)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.server.test_stop_leaves_nothing import ANNOUNCEMENT, ENV, GONE_S, START_S, serve_command
from weightsync.serving.vllm.noise import triton_unusable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


def test_a_vllm_server_says_nothing_of_triton(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    assert triton_unusable(), "this host's Triton can run: nothing to keep quiet here"
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with out_path.open("w") as out, err_path.open("w") as err:
        server = subprocess.Popen(
            serve_command(tiny_models["qwen2"], "vllm"), stdout=out, stderr=err, env=os.environ | ENV,
            start_new_session=True,
        )  # fmt: skip
    try:
        assert wait_until(lambda: ANNOUNCEMENT in out_path.read_text() or server.poll() is not None, timeout=START_S)
        assert server.poll() is None, err_path.read_text()[-3000:]
        server.send_signal(signal.SIGTERM)
        assert server.wait(GONE_S) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    said = out_path.read_text() + err_path.read_text()
    assert "vLLM" in said or "vllm" in said  # vLLM's own log is there: the check below had something to read
    noise = [line for line in said.splitlines() if "triton" in line.lower() or "nanobind" in line.lower()]
    assert noise == [], noise
