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


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(),
    reason="this host's CPU has no AMX: the SIGILL that weightsync's vLLM plugin prevents cannot happen here",
)
def test_a_bfloat16_model_serves_where_the_cpu_has_amx(tiny_models, tmp_path) -> None:
    """vLLM's CPU kernels take their AMX path for bfloat16; a worker process that never asked
    the kernel for AMX tiles died of SIGILL at the warm-up's one-token prompt. The plugin asks
    in every vLLM process (`init_amx`)."""
    import json
    import shutil

    from safetensors.torch import save_file

    model_dir = tmp_path / "qwen2-bf16"
    shutil.copytree(tiny_models["qwen2"], model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    save_file(
        {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}, str(model_dir / "model.safetensors")
    )
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    with live_server(model_dir, engine="vllm", load_format="auto") as served:
        for prompt in PROMPTS:
            answer = greedy(served, prompt)
            assert answer["weight_version"] == 0 and answer["choices"][0]["token_ids"], answer


def test_the_plugin_asks_for_amx_tiles_only_where_the_cpu_has_them(monkeypatch) -> None:
    from weightsync.integrations.vllm import plugin

    asked: list[bool] = []
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(True) or True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert plugin.init_amx() is False and asked == []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert plugin.init_amx() is True and asked == [True]


def test_the_plugin_keeps_vllms_reload_warnings_of_layers_that_load_nothing_by_design() -> None:
    """At every sync vLLM warns "Failed to load weights" for its rotary embeddings and a tied LM
    head; any other layer's warning still reaches the log."""
    import logging

    from weightsync.integrations.vllm import plugin

    plugin.quiet_reload()
    plugin.quiet_reload()  # once is enough
    logger = logging.getLogger(plugin.RELOAD_LOGGER)
    assert logger.filters.count(plugin._loads_nothing_by_design) == 1

    def shown(layer: str) -> bool:
        record = logger.makeRecord(
            logger.name, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None
        )
        return logger.filter(record) is not False

    assert not shown("RotaryEmbedding") and not shown("Llama3RotaryEmbedding") and not shown("ParallelLMHead")
    assert shown("QKVParallelLinear") and shown("FusedMoE")
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "%s: Delayed processing", ("X",), None)
    assert logger.filter(other) is not False
