"""The hf engine on its own: dummy load, ties, greedy equals generate, the in-place sink."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models import MODEL_KINDS, save_model
from weightsync import PlanError, WeightReceiver, WeightSender
from weightsync.serving.hf.base import SamplingParams
from weightsync.serving.hf.engine import HFEngine


def run_to_end(engine: HFEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    for _ in range(params.max_tokens + 1):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            tokens += output.new_token_ids
    return tokens


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_dummy_load_keeps_ties_and_holds_one_copy(tiny_models, kind) -> None:
    dummy, auto = HFEngine(tiny_models[kind], "dummy"), HFEngine(tiny_models[kind], "auto")
    tied = dummy.model.lm_head.weight.data_ptr() == dummy.model.model.embed_tokens.weight.data_ptr()
    assert tied == (kind == "qwen2")
    assert dummy.weight_bytes() == auto.weight_bytes()
    params = sum(p.numel() * p.element_size() for p in auto.model.parameters())  # unique parameters
    assert auto.weight_bytes() >= params


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_greedy_equals_transformers_generate(tiny_models, kind) -> None:
    engine = HFEngine(tiny_models[kind], "auto")
    prompt = [5, 6, 7, 8]
    tokens = run_to_end(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    expected = engine.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert tokens == expected[0, len(prompt) :].tolist()


def test_seeded_sampling_repeats(tiny_models) -> None:
    engine = HFEngine(tiny_models["qwen2"], "auto")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    assert run_to_end(engine, [1, 2, 3], params) == run_to_end(engine, [1, 2, 3], params)


def push_inproc(engine: HFEngine, tensors: dict[str, torch.Tensor], version: int = 1):  # type: ignore[no-untyped-def]
    with (
        WeightReceiver(engine.weight_sink(), "inproc") as receiver,
        WeightSender([receiver.address], raise_on_failure=False) as sender,
    ):
        return sender.push(tensors, version), receiver.state


@pytest.mark.parametrize("drop", [None, "lm_head.weight", "model.embed_tokens.weight"])
def test_tied_weights_accept_either_name(tiny_models, drop) -> None:
    checkpoint = load_file(tiny_models["qwen2"] / "model.safetensors")
    checkpoint.setdefault("lm_head.weight", checkpoint["model.embed_tokens.weight"])
    if drop:
        del checkpoint[drop]
    engine = HFEngine(tiny_models["qwen2"], "dummy")
    report, state = push_inproc(engine, checkpoint)
    assert report.ok and state == "ready"
    sent = checkpoint.get("model.embed_tokens.weight", checkpoint.get("lm_head.weight"))
    assert torch.equal(engine.model.model.embed_tokens.weight, sent)
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("lm_head.weight"), "plan lacks 'lm_head.weight'"),
        (lambda c: c.update({"bogus.weight": torch.zeros(2)}), "unknown tensor 'bogus.weight'"),
        (lambda c: c.update({"model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)}), "'model.norm.weight': sent"),
        (
            lambda c: c.update({"model.norm.weight": c["model.norm.weight"].float()}),
            "'model.norm.weight': sent float32",
        ),
    ],
)
def test_bad_plans_are_refused(tiny_models, change, message) -> None:
    checkpoint = load_file(tiny_models["llama"] / "model.safetensors")  # untied: lm_head is required
    change(checkpoint)
    engine = HFEngine(tiny_models["llama"], "dummy")
    report, state = push_inproc(engine, checkpoint)
    assert not report.ok and state == "empty"
    assert report.failed[0].kind == PlanError.__name__ and message in report.failed[0].error


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_moe")
    save_model("qwen3_moe", path)
    return path


@pytest.mark.parametrize("staged", [False, True])
def test_a_moe_checkpoint_lands_in_place_in_the_fused_experts(moe_model, tmp_path, staged) -> None:
    from transformers import AutoModelForCausalLM

    original = load_file(moe_model / "model.safetensors")  # one 2-D tensor per expert and projection
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in original
    pushed = {name: tensor + 1.0 for name, tensor in original.items()}
    save_file(pushed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for config in ("config.json", "generation_config.json"):
        shutil.copy(moe_model / config, tmp_path / config)
    engine = HFEngine(moe_model, "auto", staged=staged)
    live = {name: t.data_ptr() for name, t in engine.model.state_dict().items()}
    assert sorted(engine.weight_sink().names) == sorted(original)
    prompt = [5, 6, 7, 8]
    for version, weights, model_dir in [(1, pushed, tmp_path), (2, original, moe_model)]:
        report, state = push_inproc(engine, weights, version)
        assert report.ok and state == "ready", report
        expected = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
        held = engine.model.state_dict()
        assert held.keys() == expected.state_dict().keys()
        assert all(torch.equal(held[name], tensor) for name, tensor in expected.state_dict().items())
        assert staged or {name: t.data_ptr() for name, t in held.items()} == live  # written in place
        tokens = run_to_end(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0))
        reference = expected.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert tokens == reference[0, len(prompt) :].tolist()


def test_a_moe_engine_refuses_the_fused_names(moe_model) -> None:
    engine = HFEngine(moe_model, "auto")
    fused = {name: t.detach() for name, t in engine.model.state_dict().items()}
    report, state = push_inproc(engine, fused)
    assert not report.ok and state == "empty"
    assert "unknown tensor 'model.layers.0.mlp.experts.gate_up_proj'" in report.failed[0].error
