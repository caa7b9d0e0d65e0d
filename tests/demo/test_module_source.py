"""ModuleSource: a model's parameters, lazily, tied once, renamed, DTensor shards gathered."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.helpers import assert_all_bit_exact, receiving, sending
from weightsync import ConfigError, ModuleSource


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def test_parameters_in_order_tied_once_buffers_on_request() -> None:
    model = Tiny()
    assert [m.name for m in ModuleSource(model).metas()] == ["embed.weight", "proj.weight", "proj.bias"]
    with_buffers = [m.name for m in ModuleSource(model, buffers=True).metas()]
    assert with_buffers == ["embed.weight", "proj.weight", "proj.bias", "scale"]  # not the non-persistent cache


def test_tensors_follow_metas_and_are_the_live_values() -> None:
    model = Tiny()
    source = ModuleSource(model)
    for meta, (name, tensor) in zip(source.metas(), source.tensors(), strict=True):
        assert (meta.name, meta.shape, meta.dtype) == (name, tuple(tensor.shape), tensor.dtype)
        assert not tensor.requires_grad
    name, first = next(iter(source.tensors()))
    assert first.data_ptr() == model.embed.weight.data_ptr()  # no copy


def test_rename_by_mapping_and_callable() -> None:
    model = Tiny()
    mapped = ModuleSource(model, {"embed.weight": "model.embed_tokens.weight"})
    assert [m.name for m in mapped.metas()][0] == "model.embed_tokens.weight"
    dropped = ModuleSource(model, lambda n: None if n.startswith("proj") else f"model.{n}")
    assert [m.name for m in dropped.metas()] == ["model.embed.weight"]
    with pytest.raises(ConfigError, match="maps both"):
        ModuleSource(model, lambda n: "same")
    with pytest.raises(ConfigError, match="returned"):
        ModuleSource(model, lambda n: "")


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_push_a_model_into_another_cast_on_send(transport: str) -> None:
    trainer, rollout = Tiny(), Tiny().to(torch.bfloat16)
    with (
        receiving(dict(rollout.named_parameters()), transport) as receiver,
        sending(receiver.address, cast=torch.bfloat16) as sender,
    ):
        assert sender.push(ModuleSource(trainer), version=1).ok
    expected = {name: t.detach().to(torch.bfloat16) for name, t in trainer.named_parameters()}
    assert_all_bit_exact({n: t.detach() for n, t in rollout.named_parameters()}, expected)


def test_fsdp2_style_dtensor_parameters_are_gathered_one_by_one() -> None:
    """A DTensor-sharded module (world size 1, gloo): metas give the global shapes and the
    tensors are the gathered full tensors, not shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(6, 4)
        expected = {name: p.detach().clone() for name, p in model.named_parameters()}
        for name, param in list(model.named_parameters()):
            sharded = torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            setattr(model, name, sharded)
        source = ModuleSource(model)
        assert [(m.name, m.shape) for m in source.metas()] == [("weight", (4, 6)), ("bias", (4,))]
        gathered = dict(source.tensors())
        assert all(type(t) is torch.Tensor for t in gathered.values())
        assert_all_bit_exact(gathered, expected)
    finally:
        dist.destroy_process_group()
