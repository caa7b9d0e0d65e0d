"""HFCheckpointSource: a transformers model's weights under its checkpoint's names and layouts,
checked against what `save_pretrained` writes and transformers' own reverse conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: E402
from transformers.conversion_mapping import register_checkpoint_conversion_mapping  # noqa: E402
from transformers.core_model_loading import Chunk, Transpose, WeightConverter, revert_weight_conversion  # noqa: E402

from tests.helpers import Recorder, assert_all_bit_exact, receiving, sending  # noqa: E402
from tests.models import model_config, save_model  # noqa: E402
from weightsync import ConfigError, HFCheckpointSource  # noqa: E402
from weightsync.hf_checkpoint import checkpoint_metas, checkpoint_views  # noqa: E402
from weightsync.source import TensorMeta  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(kind)).eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2", "llama"])
def test_the_tensors_are_what_save_pretrained_writes(tmp_path: Path, kind: str) -> None:
    save_model(kind, tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")  # a trainer loads it so
    source = HFCheckpointSource(model)
    pairs = list(source.tensors())
    assert [name for name, _ in pairs] == [meta.name for meta in source.metas()]
    assert [(tuple(t.shape), t.dtype) for _, t in pairs] == [(meta.shape, meta.dtype) for meta in source.metas()]
    assert_all_bit_exact(dict(pairs), written)  # a tied lm_head is written once, sent once


def test_experts_are_yielded_one_by_one_as_views_of_the_fused_stacks() -> None:
    model = _model("qwen3_moe")
    fused = dict(model.named_parameters())
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 128)  # experts x 2*64 x hidden
    sent = dict(HFCheckpointSource(model).tensors())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in sent
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() in storages and t.is_contiguous() for t in sent.values())  # no copy
    stack = fused["model.layers.1.mlp.experts.gate_up_proj"]
    assert sent["model.layers.1.mlp.experts.2.gate_proj.weight"].data_ptr() == stack[2, :64].data_ptr()
    assert sent["model.layers.1.mlp.experts.2.up_proj.weight"].data_ptr() == stack[2, 64:].data_ptr()
    assert_all_bit_exact(sent, revert_weight_conversion(model, model.state_dict()))


def test_checkpoint_views_cut_the_fused_stacks_in_place() -> None:
    model = _model("qwen3_moe")
    state = model.state_dict()
    views = checkpoint_views(model, state)
    metas = checkpoint_metas(model, [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in state.items()])
    assert {name: tuple(v.shape) for name, v in views.items()} == {
        meta.name: meta.shape for entries in metas.values() for meta in entries
    }
    assert_all_bit_exact(views, revert_weight_conversion(model, model.state_dict()))
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert all(v.untyped_storage().data_ptr() in storages for v in views.values())  # views, no copy
    views["model.layers.1.mlp.experts.2.up_proj.weight"].fill_(3.0)
    views["model.layers.0.mlp.experts.3.down_proj.weight"].fill_(-2.0)
    stack = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert (stack[2, 64:] == 3.0).all() and not (stack[2, :64] == 3.0).any() and not (stack[1] == 3.0).any()
    assert (state["model.layers.0.mlp.experts.down_proj"][3] == -2.0).all()


def test_checkpoint_views_keep_a_tensor_only_transformers_converts_under_its_model_name() -> None:
    model = TransposedDownQwen2(model_config("qwen2"))
    views = checkpoint_views(model, dict(model.named_parameters()))
    down = model.model.layers[1].mlp.down_proj.weight
    assert views["model.layers.1.mlp.down_proj.weight"] is down
    assert "model.layers.1.mlp.down_t.weight" not in views


def test_a_sender_pushes_it_bit_exact() -> None:
    model = _model("qwen3_moe")
    source = HFCheckpointSource(model)
    sink = Recorder()
    with receiving(sink, "inproc") as receiver, sending([receiver.address], bucket_bytes=1 << 16) as sender:
        report = sender.push(source, version=1)
    assert report.ok, report
    assert_all_bit_exact(sink.received, dict(source.tensors()))


class TransposedDownQwen2(Qwen2ForCausalLM):
    """A Qwen2 whose checkpoint (as registered below) stores each down_proj transposed, under
    another name: a conversion transformers applies by an op other than a split."""


class FusedQkvQwen2(Qwen2ForCausalLM):
    """A Qwen2 whose checkpoint (as registered below) joins q, k and v into one tensor."""


@pytest.fixture(scope="module", autouse=True)
def _conversions() -> None:
    """transformers' public registry of checkpoint conversions, for the two classes above."""
    transposed = WeightConverter("mlp.down_t.weight", "mlp.down_proj.weight", operations=[Transpose(0, 1)])
    register_checkpoint_conversion_mapping(TransposedDownQwen2.__name__, [transposed], overwrite=True)
    targets = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    joined = WeightConverter("self_attn.qkv.weight", targets, operations=[Chunk(dim=0)])
    register_checkpoint_conversion_mapping(FusedQkvQwen2.__name__, [joined], overwrite=True)


def test_an_op_that_is_no_split_is_left_to_transformers() -> None:
    torch.manual_seed(0)
    model = TransposedDownQwen2(model_config("qwen2"))
    sent = dict(HFCheckpointSource(model).tensors())
    down = model.model.layers[1].mlp.down_proj.weight
    assert "model.layers.1.mlp.down_proj.weight" not in sent
    assert torch.equal(sent["model.layers.1.mlp.down_t.weight"], down.T)
    assert_all_bit_exact(sent, revert_weight_conversion(model, dict(model.named_parameters())))


def test_a_checkpoint_that_joins_tensors_is_refused() -> None:
    model = FusedQkvQwen2(model_config("qwen2"))
    with pytest.raises(ConfigError, match=r"joins several of its tensors into one \('model.layers.0.self_attn.qkv"):
        HFCheckpointSource(model)
