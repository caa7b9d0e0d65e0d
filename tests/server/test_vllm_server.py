"""A real server with the vllm engine: gated until the first sync, then serving exactly what the
checkpoint serves, refusing bad pushes without losing the served version."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.server.checks import check_staged, check_stop_strings, check_top_logprobs
from tests.server.conftest import live_server
from tests.server.test_server import PROMPTS, greedy, push
from weightsync.checkpoint import SafetensorsSource
from weightsync.client import ServerError

pytest.importorskip("vllm")

# vLLM's own imports warn (deprecated torch.jit APIs, future changes): not ours to fix.
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_vllm_server_gates_then_serves_pushed_weights(tiny_models, transport) -> None:
    model_dir = tiny_models["qwen2"]
    with (
        live_server(model_dir, engine="vllm", transport=transport, ready_timeout=0.5) as dummy,
        live_server(model_dir, engine="hf", load_format="auto") as reference,
    ):
        assert dummy.client.health()["status"] == "unavailable"
        with pytest.raises(ServerError) as refused:
            greedy(dummy, PROMPTS[0])
        assert refused.value.status == 503

        report = push(dummy, SafetensorsSource(model_dir), 1)
        assert report.ok, report.failed
        assert dummy.client.health()["status"] == "ok"
        for prompt in PROMPTS:
            served, expected = greedy(dummy, prompt), greedy(reference, prompt)
            assert served["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
            assert served["weight_version"] == served["choices"][0]["weight_version"] == 1

        bad = load_file(str(model_dir / "model.safetensors"))
        name = next(iter(bad))
        bad[name] = torch.zeros(3, dtype=bad[name].dtype)  # wrong shape
        report = push(dummy, bad, 2)
        assert report.failed and report.failed[0].kind == "PlanError"
        after = greedy(dummy, PROMPTS[0])
        assert after["weight_version"] == 1
        assert after["choices"][0]["token_ids"] == greedy(reference, PROMPTS[0])["choices"][0]["token_ids"]


def test_vllm_stop_strings_and_top_logprobs(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    with (
        live_server(model_dir, engine="vllm", load_format="auto") as served,
        live_server(model_dir, engine="hf", load_format="auto") as reference,
    ):
        check_stop_strings(served)
        check_top_logprobs(served, reference.server.engine.model)


def test_vllm_staged_server_serves_during_the_transfer_and_survives_a_failed_sync(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    with live_server(model_dir, engine="vllm", staged=True) as server:
        check_staged(server, load_file(str(model_dir / "model.safetensors")))
