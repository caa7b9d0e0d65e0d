"""`MegatronSource` refuses, when it is built (before a byte moves), a parameter it cannot name or
place, with one line naming it; and places a tensor-parallel rank's boxes from Megatron's own
parameter attributes. A stand-in module with Megatron's names and attributes: no megatron-core."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from weightsync import ConfigError
from weightsync.integrations.megatron import MegatronSource


class Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def stand_in(extra: str = "", stride: int = 1) -> torch.nn.Module:
    """One rank (of 1) of a 1-layer GPTModel at TP=1, its tensor-parallel group said to be 1 of 1."""
    model = torch.nn.Module()
    model.vocab_size, model.share_embeddings_and_output_weights = 8, True  # type: ignore[assignment]
    model.config = SimpleNamespace(num_attention_heads=2, num_query_groups=1, kv_channels=2)  # type: ignore[assignment]
    model.decoder = torch.nn.Module()
    layer = torch.nn.Module()
    layer.layer_number = 1  # type: ignore[assignment]
    layer.mlp = torch.nn.Module()
    layer.mlp.linear_fc2 = torch.nn.Linear(4, 4, bias=False)
    layer.mlp.linear_fc2.tp_group = Group(0, 1)  # type: ignore[assignment]
    weight = layer.mlp.linear_fc2.weight
    weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 1, stride  # type: ignore[attr-defined]
    if extra:
        layer.mlp.register_parameter(extra, torch.nn.Parameter(torch.zeros(2)))
    model.decoder.layers = torch.nn.ModuleList([layer])
    return model


def test_a_parameter_with_no_checkpoint_name_or_an_unknown_split_is_refused_naming_it() -> None:
    source = MegatronSource(stand_in())
    assert [meta.name for meta in source.metas()] == ["model.layers.0.mlp.down_proj.weight"]
    assert [name for name, _ in source.held()] == ["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ConfigError, match=r"^decoder\.layers\.0\.mlp\.shared_gate: a Megatron parameter with no"):
        MegatronSource(stand_in(extra="shared_gate"))
    with pytest.raises(ConfigError, match=r"linear_fc2\.weight: split on dim 1 with stride 3"):
        MegatronSource(stand_in(stride=3))
