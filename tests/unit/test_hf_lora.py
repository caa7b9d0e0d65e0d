"""The hf engine's LoRA slots: a version's slot is reused by a later version of the same shape
only once no request runs on it, and what it serves is always the version it was pinned to."""

from __future__ import annotations

import pytest
import torch

from weightsync import adapter_from_peft
from weightsync.serving.hf.lora import LoraServing

peft = pytest.importorskip("peft")


def tiny_base():  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def trained(seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj")):  # type: ignore[no-untyped-def]
    """A PEFT model over the same base, its adapter drawn from `seed` (B non-zero)."""
    model = peft.get_peft_model(
        tiny_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(std=0.5)
    return model.eval()


PROMPT = torch.tensor([[1, 2, 3, 4]])


def logits(model) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return model(input_ids=PROMPT).logits


def served_logits(serving: LoraServing, engine_id: str) -> torch.Tensor:
    serving.activate(engine_id)
    try:
        return logits(serving.model)
    finally:
        serving.activate(None)


def peft_modules(model) -> int:  # type: ignore[no-untyped-def]
    return len(getattr(model, "peft_config", {}))


def test_versions_of_one_shape_reuse_freed_slots_and_serve_their_own_weights() -> None:
    serving = LoraServing(tiny_base(), keep=2, max_rank=8)
    for version in range(1, 7):
        policy = trained(seed=version)
        tensors, adapter = adapter_from_peft(policy, "policy")
        serving.install(adapter, version, tensors)
        newest = serving.pin("policy")
        assert newest.version == version
        torch.testing.assert_close(served_logits(serving, newest.engine_id), logits(policy), rtol=0, atol=1e-5)
        serving.release(newest.engine_id)
    assert peft_modules(serving.model) == 3  # two kept, one freed and refilled: never one per version
    assert [v.version for v in serving.snapshot[0].versions] == [5, 6]


def test_a_pinned_version_keeps_its_slot_while_newer_versions_land() -> None:
    serving = LoraServing(tiny_base(), keep=1, max_rank=8)
    first = trained(seed=1)
    tensors, adapter = adapter_from_peft(first, "policy")
    serving.install(adapter, 1, tensors)
    pinned = serving.pin("policy")  # a request still running on version 1
    for version in range(2, 5):
        tensors, adapter = adapter_from_peft(trained(seed=version), "policy")
        serving.install(adapter, version, tensors)
        torch.testing.assert_close(served_logits(serving, pinned.engine_id), logits(first), rtol=0, atol=1e-5)
    serving.release(pinned.engine_id)  # now version 1's slot is free for the next version
    fifth = trained(seed=5)
    tensors, adapter = adapter_from_peft(fifth, "policy")
    before = peft_modules(serving.model)
    serving.install(adapter, 5, tensors)
    assert peft_modules(serving.model) == before
    torch.testing.assert_close(
        served_logits(serving, serving.pin("policy").engine_id), logits(fifth), atol=1e-5, rtol=0
    )


def test_another_shape_gets_a_slot_of_its_own() -> None:
    serving = LoraServing(tiny_base(), keep=1, max_rank=8)
    narrow = trained(seed=1)
    tensors, adapter = adapter_from_peft(narrow, "policy")
    serving.install(adapter, 1, tensors)
    wide = trained(seed=2, targets=("q_proj", "v_proj", "down_proj"))
    tensors, adapter = adapter_from_peft(wide, "policy")
    serving.install(adapter, 2, tensors)  # version 1's slot is free, but holds other modules
    newest = serving.pin("policy")
    torch.testing.assert_close(served_logits(serving, newest.engine_id), logits(wide), rtol=0, atol=1e-5)
    assert peft_modules(serving.model) == 2
