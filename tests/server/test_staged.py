"""Staged syncs (hf engine; vLLM's are in test_vllm_server.py): a sync lands in a standby copy and
commit swaps it in, so a sync that fails midway leaves the served weights and version exactly as
they were, and the engine serves the current version while the next one arrives."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.models import save_model
from tests.server.checks import check_staged
from tests.server.conftest import live_server
from tests.server.test_server import PROMPTS, greedy, push
from weightsync.errors import ConfigError
from weightsync.landing import Landing


def test_staged_swap_serves_each_pushed_version(tiny_models, tmp_path) -> None:
    model_dir = tiny_models["qwen2"]  # tied embeddings: one standby tensor for both names
    save_model("qwen2", tmp_path / "other", seed=1)
    first, second = load_file(model_dir / "model.safetensors"), load_file(tmp_path / "other" / "model.safetensors")
    with (
        live_server(model_dir, staged=True) as staged,
        live_server(model_dir, load_format="auto") as reference,
        live_server(tmp_path / "other", load_format="auto") as other,
    ):
        for version, (weights, expected) in enumerate([(first, reference), (second, other), (first, reference)], 1):
            assert push(staged, weights, version).ok
            for prompt in PROMPTS:
                assert (
                    greedy(staged, prompt)["choices"][0]["token_ids"]
                    == greedy(expected, prompt)["choices"][0]["token_ids"]
                )
        model = staged.server.engine.model
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survived the swaps


@pytest.mark.fault(
    "a sync fails in its last bucket on a staged server (--staged)",
    expected="the served weights and version stay exactly as they were (ready, not dirty); next push commits",
)
def test_a_failed_staged_sync_leaves_the_served_weights_untouched(tiny_models, monkeypatch, observe) -> None:
    model_dir = tiny_models["llama"]
    good = load_file(model_dir / "model.safetensors")
    with live_server(model_dir, staged=True) as server:
        assert push(server, good, 1).ok
        before = greedy(server, PROMPTS[0])["choices"][0]["token_ids"]
        live = {n: t.clone() for n, t in server.server.engine.model.state_dict().items()}
        original = Landing.finish_bucket

        def fail_late(self: Landing, index: int, checksum: int | None = None) -> None:
            if index == len(self.plan.buckets) - 1:
                raise ConfigError("injected failure in the last bucket")
            original(self, index, checksum)

        monkeypatch.setattr(Landing, "finish_bucket", fail_late)
        report = push(server, {n: t * 2 for n, t in good.items()}, 2)
        monkeypatch.setattr(Landing, "finish_bucket", original)
        assert not report.ok
        info = server.client.weight_info()
        assert (info["version"], info["state"]) == (1, "ready"), info  # not dirty: nothing live was written
        assert server.client.health()["status"] == "ok"
        assert greedy(server, PROMPTS[0])["choices"][0]["token_ids"] == before
        for name, tensor in server.server.engine.model.state_dict().items():
            assert torch.equal(tensor, live[name]), name
        assert push(server, good, 3).ok
        observe(
            f"sender: {report.failed[0].kind}; server after: {info['state']}, version {info['version']}, "
            "health ok, same greedy tokens, every weight bit-identical; version 3 committed"
        )


def test_a_staged_server_serves_during_the_transfer(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    with live_server(model_dir, staged=True) as server:
        check_staged(server, load_file(model_dir / "model.safetensors"))
