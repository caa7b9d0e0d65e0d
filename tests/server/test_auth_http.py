"""A rollout server with a token: control endpoints want `Authorization: Bearer`, pushes must
prove the token (HMAC), /health stays open, and generation can be opened on its own."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.server.conftest import live_server
from weightsync import WeightSender
from weightsync.client import RolloutClient, ServerError
from weightsync.errors import ConfigError
from weightsync.options import ReceiverOptions
from weightsync.serving.config import ServeConfig

TOKEN = "correct horse battery staple"


def test_control_and_generation_need_the_token(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    weights = load_file(model_dir / "model.safetensors")
    with live_server(model_dir, auth_token=TOKEN, transport="tcp") as server:
        assert server.client.health()["status"] == "unavailable"  # open, for liveness probes
        for call in (server.client.weight_info, server.client.resume, lambda: server.client.completions("ab")):
            with pytest.raises(ServerError) as refused:
                call()
            assert refused.value.status == 401 and "auth token" in str(refused.value)
        with RolloutClient(server.url, auth_token="a wrong token, long enough") as wrong:
            with pytest.raises(ServerError, match="auth token"):
                wrong.weight_info()
        with WeightSender([server.address], timeout=10, raise_on_failure=False) as anonymous:
            report = anonymous.push(weights, 1)
            assert report.failed and report.failed[0].kind == "AuthError"
        with RolloutClient(server.url, auth_token=TOKEN) as client:
            assert client.weight_info()["version"] is None
            with WeightSender([server.address], timeout=10, auth_token=TOKEN, raise_on_failure=False) as sender:
                assert sender.push(weights, 1).ok
            assert client.completions("ab", max_tokens=2)["weight_version"] == 1
            assert client.pause("wait")["paused"] and not client.resume()["paused"]


def test_generation_can_be_opened_without_the_control_endpoints(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    with live_server(model_dir, auth_token=TOKEN, allow_unauthenticated_generation=True, load_format="auto") as server:
        assert server.client.completions("ab", max_tokens=2)["weight_version"] == 0
        with pytest.raises(ServerError) as refused:
            server.client.pause("abort")
        assert refused.value.status == 401


def test_listening_beyond_loopback_needs_a_token(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSYNC_AUTH_TOKEN", raising=False)
    model = str(tiny_models["qwen2"])
    with pytest.raises(ConfigError, match="HTTP API would listen on '0.0.0.0'"):
        ServeConfig(model=model, host="0.0.0.0")
    with pytest.raises(ConfigError, match="weight receiver would listen"):
        ServeConfig(model=model, transport="tcp", receiver=ReceiverOptions(host="10.0.0.1"))
    assert ServeConfig(model=model, host="0.0.0.0", auth_token=TOKEN).auth_token == TOKEN
