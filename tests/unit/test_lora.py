"""What a trainer hands a push for a LoRA adapter: from a PEFT model or from the folder PEFT
saves, the same tensors and the same Adapter; and what cannot be pushed, refused with its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_all_bit_exact
from weightsync import Adapter, ConfigError, adapter_from_peft
from weightsync.lora import adapter_from_dir, base_from_peft

peft = pytest.importorskip("peft")


def tiny_peft(**lora: object):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    base = Qwen2ForCausalLM(config)
    original = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False} | lora
    return peft.get_peft_model(base, peft.LoraConfig(**options)), original


def test_a_saved_adapter_is_the_same_push_as_the_live_one(tmp_path: Path) -> None:
    model, _ = tiny_peft()
    tensors, adapter = adapter_from_peft(model, "policy")
    assert adapter == Adapter("policy", 4, 8.0, ("q_proj", "v_proj"))
    assert len(tensors) == 8 and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in tensors)
    model.save_pretrained(tmp_path)
    saved, saved_adapter = adapter_from_dir(tmp_path, "policy")
    assert saved_adapter == adapter
    assert_all_bit_exact(saved, tensors)


def test_the_base_under_a_peft_model_has_the_base_models_names() -> None:
    model, original = tiny_peft()
    assert_all_bit_exact(base_from_peft(model), original)


@pytest.mark.parametrize(
    ("lora", "named"),
    [({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias='all'"), ({"rank_pattern": {"q_proj": 2}}, "rank_pattern")],
)
def test_what_a_plain_lora_push_cannot_carry_is_refused_by_name(lora: dict[str, object], named: str) -> None:
    model, _ = tiny_peft(**lora)
    with pytest.raises(ConfigError, match=named):
        adapter_from_peft(model, "policy")


@pytest.mark.parametrize("name", ["", "a/b", "a@1"])
def test_an_adapter_name_a_url_or_version_could_not_carry_is_refused(name: str) -> None:
    model, _ = tiny_peft()
    with pytest.raises(ConfigError, match="name"):
        adapter_from_peft(model, name)


def test_a_folder_that_is_no_saved_adapter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a saved PEFT adapter"):
        adapter_from_dir(tmp_path, "policy")
