"""No success without output: an engine that fails is a 5xx with a clear body, counted, and made
visible in /health; an engine that cannot run the model refuses to start; a model without a
tokenizer refuses text prompts and says why."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import live_server
from weightsync.checkpoint import SafetensorsSource
from weightsync.errors import ConfigError
from weightsync.serving.config import ServeConfig
from weightsync.serving.hf import server as runtime
from weightsync.serving.hf.engine import HFEngine
from weightsync.serving.hf.server import FAILED_STEPS_UNHEALTHY, RolloutServer

SRC = str(Path(__file__).resolve().parents[2] / "src")

INJECTED = "Unsupported CPU attention configuration: head_dim=16 (injected)"


class FlakyEngine(HFEngine):
    """The hf engine, whose steps raise while `failing` is set."""

    failing = False

    def step(self) -> list[Any]:
        if self.failing:
            raise RuntimeError(INJECTED)
        return super().step()


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(config: ServeConfig) -> FlakyEngine:
        return FlakyEngine(config.model, load_format=config.load_format)

    monkeypatch.setattr(runtime, "build_engine", build)


def complete(url: str, prompt: object = "ab") -> httpx.Response:
    # greedy: a sampled token could be the end of the text, and the checks count two tokens
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=30)


@pytest.mark.fault(
    "engine failure: the engine raises in its steps while serving",
    expected="every request gets a 500 whose JSON error names the engine's error (never a 200 with empty "
    "text); counted in /metrics; after 3 failed steps in a row /health is 503 'failed'; the next good step "
    "serves again",
)
def test_an_engine_failure_is_a_500_counted_and_unhealthy(tiny_models, flaky, observe) -> None:
    with live_server(tiny_models["qwen2"], load_format="auto") as server:
        engine = server.server.engine
        assert complete(server.url).status_code == 200
        engine.failing = True  # type: ignore[attr-defined]
        answers = [complete(server.url) for _ in range(FAILED_STEPS_UNHEALTHY)]
        assert [a.status_code for a in answers] == [500] * FAILED_STEPS_UNHEALTHY
        body = answers[0].json()
        assert body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 500
        assert body["error"]["message"] == f"the engine failed: {INJECTED}"
        health = server.client.health()
        assert (health["status"], health["state"]) == ("unavailable", "failed"), health
        assert f"failed its last {FAILED_STEPS_UNHEALTHY} steps: {INJECTED}" in health["reason"]
        metrics = server.client.metrics()
        assert f"weightsync_engine_failures_total {FAILED_STEPS_UNHEALTHY:.1f}" in metrics
        assert f'weightsync_requests_total{{status="500"}} {FAILED_STEPS_UNHEALTHY:.1f}' in metrics
        engine.failing = False  # type: ignore[attr-defined]
        recovered = complete(server.url)
        assert recovered.status_code == 200 and len(recovered.json()["choices"][0]["token_ids"]) == 2
        assert server.client.health()["status"] == "ok"
        observe(
            f"{FAILED_STEPS_UNHEALTHY} requests: HTTP 500 `{body['error']['message'][:60]}`; /health 503 "
            f"state failed; metrics counted {FAILED_STEPS_UNHEALTHY} engine failures and 500s; after the "
            "engine recovered: 200 with 2 tokens, health ok"
        )


def test_an_engine_that_cannot_generate_refuses_to_start(tiny_models, flaky, monkeypatch) -> None:
    monkeypatch.setattr(FlakyEngine, "failing", True)
    with pytest.raises(ConfigError, match="cannot run .*a one-token warm-up generation failed: Unsupported CPU"):
        RolloutServer(ServeConfig(model=str(tiny_models["qwen2"])))


@pytest.fixture
def no_tokenizer(tiny_models, tmp_path) -> Path:  # type: ignore[no-untyped-def]
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_models["qwen2"] / name, model / name)
    return model


def test_a_model_without_a_tokenizer_refuses_text_prompts_and_says_why(no_tokenizer) -> None:
    with live_server(no_tokenizer) as server:
        from weightsync import WeightSender

        with WeightSender([server.address], timeout=20.0) as sender:
            assert sender.push(SafetensorsSource(no_tokenizer), 1).ok
        refused = complete(server.url, "ab")
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "need a tokenizer" in message and "has no tokenizer" in message and "token ids" in message
        served = complete(server.url, [5, 6, 7])
        assert served.status_code == 200 and len(served.json()["choices"][0]["token_ids"]) == 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vllm_refuses_to_start_on_a_model_its_cpu_backend_cannot_run(tmp_path) -> None:
    """head_dim 16: vLLM's CPU attention has no kernel for it. The server used to start, accept
    pushes and answer every completion with HTTP 200 and empty text. vLLM's engine runs in its own
    processes: its root cause is in its log, our one line says what failed; vLLM's children may
    print more after it as they exit."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tests.models import EOS_ID, save_tokenizer

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,  # head_dim 16
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=EOS_ID,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "weightsync", "serve", "--engine", "vllm", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": SRC, "VLLM_CPU_KVCACHE_SPACE": "1"},
        timeout=300,
    )
    ours = [line for line in done.stderr.splitlines() if line.startswith("weightsync serve:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith("weightsync serve: the vllm engine cannot run"), ours
    assert "one-token warm-up generation failed" in ours[0]
    assert "Unsupported CPU attention configuration: head_dim=16" in done.stdout + done.stderr
    # vLLM's engine-core process logs its own traceback of the root cause (sometimes, as it exits);
    # ours must print none: no frame of weightsync's command in any traceback.
    assert not re.search(r'File ".*weightsync/(cli|__main__|integrations/vllm)', done.stderr), done.stderr[-3000:]
