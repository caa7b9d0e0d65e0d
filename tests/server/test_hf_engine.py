"""The hf engine on its own: dummy load, ties, greedy equals generate, the in-place sink."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.models import MODEL_KINDS
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
