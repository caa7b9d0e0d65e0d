"""`weightsync serve` and `weightsync push` as processes, end to end; and the memory point: the
serving process holds one copy of the model (weights land in place)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import WAIT_S
from weightsync.client import RolloutClient

SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightsync", *args]


def env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


class Served:
    def __init__(self, model: Path, *extra: str) -> None:
        self.process = subprocess.Popen(
            cli("serve", "--model", str(model), "--port", "0", *extra),
            stdout=subprocess.PIPE,
            text=True,
            env=env(),
        )
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("weightsync serve: http://"), line
        self.url = line.split()[2]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(WAIT_S)
        self.process.stdout.close()  # type: ignore[union-attr]


def push(model: Path, *urls: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run(
        cli("push", "--model", str(model), "--to", *urls, "--json"),
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_serve_and_push_end_to_end(tiny_models) -> None:
    model = tiny_models["qwen2"]
    servers = [Served(model, "--ready-timeout", "0.1"), Served(model, "--transport", "tcp")]
    try:
        with RolloutClient(servers[0].url) as client:
            assert client.health()["status"] == "unavailable"
            report = push(model, *(s.url for s in servers))
            assert report["ok"] and report["version"] == 1 and len(report["outcomes"]) == 2
            assert client.completions("hi", max_tokens=3, temperature=0)["weight_version"] == 1
            assert push(model, servers[0].url)["version"] == 2  # default: highest served + 1
            assert client.weight_info()["version"] == 2
    finally:
        for server in servers:
            server.close()


def test_push_to_nowhere_fails_cleanly(tiny_models) -> None:
    done = subprocess.run(
        # a refused port is waited for the whole --timeout (a server binds its port only after
        # its imports): a short one, so that the push fails within the test's wait
        cli("push", "--model", str(tiny_models["qwen2"]), "--to", "http://127.0.0.1:9", "--timeout", "5"),
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert done.returncode == 1 and "failed" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_serving_process_holds_one_copy(tmp_path) -> None:
    """USS (private memory) grows by about the weights' size when a sync lands, not twice that."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.models import model_config, save_tokenizer

    config = model_config("llama")
    config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers = 8192, 512, 1536, 4
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)  # ~30 MB of weights
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    del model
    served = Served(tmp_path)
    try:
        process = psutil.Process(served.process.pid)
        with RolloutClient(served.url) as client:
            weight_bytes = client.weight_info()["weight_bytes"]
            before = process.memory_full_info().uss
            assert push(tmp_path, served.url)["ok"]
            grown = process.memory_full_info().uss - before
        assert weight_bytes > 25e6
        assert grown < 1.35 * weight_bytes, f"USS grew {grown} bytes for {weight_bytes} bytes of weights"
    finally:
        served.close()
