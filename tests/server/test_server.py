"""A real server (uvicorn on 127.0.0.1) with the hf engine: the gate, pushes, versions, metrics."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import WAIT_S
from tests.models import MODEL_KINDS
from tests.server.conftest import live_server
from weightsync import WeightSender
from weightsync.checkpoint import SafetensorsSource
from weightsync.client import ServerError
from weightsync.options import ReceiverOptions

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def greedy(server, prompt, max_tokens: int = 12) -> dict:  # type: ignore[no-untyped-def]
    return server.client.completions(prompt, max_tokens=max_tokens, temperature=0)


def push(server, tensors, version: int):  # type: ignore[no-untyped-def]
    """The push's report, committed or not (the tests read each outcome)."""
    with WeightSender([server.address], timeout=20.0, raise_on_failure=False) as sender:
        return sender.push(tensors, version)


def test_503_until_the_first_sync(tiny_models) -> None:
    with live_server(tiny_models["qwen2"], ready_timeout=0.2) as server:
        health = server.client.health()
        assert health["status"] == "unavailable" and "no weights committed" in health["reason"]
        with pytest.raises(ServerError) as raised:
            greedy(server, "abc")
        assert raised.value.status == 503 and "push weights first" in str(raised.value)
        assert server.client.weight_info()["version"] is None
        assert push(server, SafetensorsSource(tiny_models["qwen2"]), 1).ok
        assert server.client.health()["status"] == "ok"
        assert greedy(server, "abc")["weight_version"] == 1


@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("transport", ["shm", "tcp", "nixl"])
def test_pushed_weights_serve_like_the_checkpoint(tiny_models, kind, transport) -> None:
    model_dir = tiny_models[kind]
    with (
        live_server(model_dir, transport=transport) as dummy,
        live_server(model_dir, load_format="auto") as auto,
    ):
        report = push(dummy, SafetensorsSource(model_dir), 3)
        assert report.ok, report.failed
        info = dummy.client.weight_info()
        assert info["version"] == 3 and info["last_sync"]["bytes"] == report.total_bytes
        assert info["addresses"] == [dummy.address] and info["addresses"][0].startswith(transport)
        reference = auto.server.engine.model
        for prompt in PROMPTS:
            pushed, loaded = greedy(dummy, prompt), greedy(auto, prompt)
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
            assert pushed["choices"][0]["token_ids"] == loaded["choices"][0]["token_ids"]
            assert pushed["choices"][0]["token_ids"] == expected[0, len(prompt) :].tolist()
            assert (pushed["weight_version"], pushed["choices"][0]["weight_version"]) == (3, 3)
            assert (loaded["weight_version"], loaded["choices"][0]["weight_version"]) == (0, 0)


def test_every_response_and_choice_carries_its_version(tiny_models) -> None:
    with live_server(tiny_models["qwen2"]) as server:
        push(server, SafetensorsSource(tiny_models["qwen2"]), 1)
        body = server.client.completions(["ab", "cd"], max_tokens=3, temperature=0.8, seed=1, n=3, logprobs=0)
        assert len(body["choices"]) == 6 and body["weight_version"] == 1
        for choice in body["choices"]:  # one version: one span over every token
            assert choice["weight_version"] == 1
            assert choice["weight_versions"] == [{"version": 1, "start": 0, "end": len(choice["token_ids"])}]
        assert all(len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) for c in body["choices"])
        answer = httpx.get(f"{server.url}/v1/models", timeout=WAIT_S * 3)
        assert answer.status_code == 200, answer.text
        models = answer.json()
        assert models["data"][0]["id"] == "qwen2" and models["data"][0]["weight_version"] == 1


@pytest.mark.fault(
    "a push that does not match the engine's parameters (extra, wrong shape, wrong dtype, missing)",
    expected="PlanError listing the mismatch before any byte lands; the server keeps serving the previous version",
)
def test_bad_pushes_are_refused_and_the_previous_version_serves(tiny_models, observe) -> None:
    model_dir = tiny_models["llama"]
    good = load_file(model_dir / "model.safetensors")
    with live_server(model_dir) as server:
        push(server, good, 1)
        before = greedy(server, PROMPTS[0])["choices"][0]["token_ids"]
        bad_pushes = {
            "unknown tensor 'extra.weight'": good | {"extra.weight": torch.zeros(4, dtype=torch.bfloat16)},
            "'model.norm.weight': sent bfloat16[7]": good | {"model.norm.weight": torch.zeros(7, dtype=torch.bfloat16)},
            "'model.norm.weight': sent float32": good | {"model.norm.weight": good["model.norm.weight"].float()},
            "plan lacks 'lm_head.weight'": {k: v for k, v in good.items() if k != "lm_head.weight"},
        }
        seen = []
        for version, (message, tensors) in enumerate(bad_pushes.items(), start=2):
            report = push(server, tensors, version)
            seen.append(f"{report.failed[0].kind} `{message}`")
            assert not report.ok and report.failed[0].kind == "PlanError" and message in report.failed[0].error
            after = greedy(server, PROMPTS[0])
            assert after["weight_version"] == 1 and after["choices"][0]["token_ids"] == before
            assert server.client.health()["status"] == "ok"
        info = server.client.weight_info()
        assert info["version"] == 1 and info["last_sync"]["num_committed"] == 1
        assert "plan lacks" in info["last_error"]
        observe("; ".join(seen) + "; after each: health ok, version 1 served, same greedy tokens")


def test_metrics(tiny_models) -> None:
    with live_server(tiny_models["qwen2"]) as server:
        push(server, SafetensorsSource(tiny_models["qwen2"]), 5)
        greedy(server, "x", max_tokens=2)
        text = server.client.metrics()
        for line in [
            'weightsync_syncs_total{outcome="committed"} 1.0',
            "weightsync_weight_version 5.0",
            "weightsync_sync_in_progress 0.0",
            "weightsync_requests_waiting_at_gate 0.0",
            "weightsync_sync_duration_seconds_count 1.0",
            'weightsync_requests_total{status="200"} 1.0',
        ]:
            assert line in text, line
        assert "weightsync_sync_bytes_total 1.24" in text  # 1249792 bytes


def test_bad_requests_get_clear_errors(tiny_models) -> None:
    with live_server(tiny_models["qwen2"], load_format="auto") as server:
        for fields, status, message in [
            ({"prompt": [999]}, 400, "prompt token ids must lie in [0, 128)"),
            ({"prompt": ""}, 400, "no tokens"),
            ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
            ({"prompt": "a", "model": "other"}, 404, "is not served here"),
            ({"prompt": [999], "stream": True}, 400, "prompt token ids must lie in [0, 128)"),  # before the stream
            ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ]:
            answer = httpx.post(f"{server.url}/v1/completions", json=fields, timeout=WAIT_S * 3)
            assert answer.status_code == status and message in answer.text, answer.text
        assert greedy(server, "a", max_tokens=1)["weight_version"] == 0


def test_a_server_that_requires_verified_pushes(tiny_models) -> None:
    with live_server(tiny_models["qwen2"], receiver=ReceiverOptions(verify="bucket"), transport="tcp") as server:
        report = push(server, SafetensorsSource(tiny_models["qwen2"]), 1)  # the sender's default: off
        assert report.ok, report.failed
        assert greedy(server, "abc")["weight_version"] == 1
        # what the server verified it holds is what the trainer sent
        assert report.content_digest and server.client.weight_info()["content_digest"] == report.content_digest


def test_a_sync_says_where_its_time_went(tiny_models) -> None:
    with live_server(tiny_models["qwen2"]) as server:
        report = push(server, SafetensorsSource(tiny_models["qwen2"]), 1)
        times = server.client.weight_info()["last_sync"]["times"]
        assert set(times) == {"total_s", "transfer_s", "landing_s", "load_s", "pause_s"}
        assert times["total_s"] <= report.seconds
        assert times == pytest.approx(msgspec.structs.asdict(report.outcomes[0].times), abs=1e-5)
        text = server.client.metrics()
        for phase in ("transfer", "landing", "load", "pause"):
            assert f'weightsync_sync_phase_seconds_count{{phase="{phase}"}} 1.0' in text, phase
