"""cudaipc where there is no GPU: a clear error at once, on either side, and the direct path's
pieces that need no GPU (its messages, the sender's and the receiver's caches, the checks of what
a peer sends). tests/gpu covers the rest."""

from __future__ import annotations

import pytest
import torch

from weightsync import ModuleSource, Plan, StateDictSource, TensorMeta, WeightReceiver, WeightSender
from weightsync.errors import ConfigError, ProtocolError
from weightsync.plan import build_plan, wire_specs
from weightsync.source import held_tensors
from weightsync.transports import cudaipc, get_transport
from weightsync.transports.cudaipc import (
    CudaHandle,
    DeviceRing,
    DirectTensor,
    OpenedStorages,
    Shared,
    SharedStorages,
    check_quiet,
    check_view,
    share_tensors,
)
from weightsync.wire import decode, encode


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cudaipc_without_a_gpu_is_refused_at_once_on_both_sides():
    with pytest.raises(ConfigError, match="cudaipc transport needs CUDA on the receiver"):
        WeightReceiver({"w": torch.zeros(2)}, transport="cudaipc").start()
    with pytest.raises(ConfigError, match="cudaipc transport needs CUDA on the sender"):
        WeightSender(["cudaipc://@somewhere"])
    with pytest.raises(ConfigError, match=r"must look like cudaipc://@NAME"):
        WeightSender(["cudaipc://nowhere"])


# --- the direct path's pieces that need no GPU ------------------------------------------------------


def handle(name: bytes, offset: int = 0, size: int = 64) -> CudaHandle:
    return CudaHandle(0, name, size, offset, b"/torch_refcount", 3, b"\x01" * 64, True)


def plan_of(named: dict[str, torch.Tensor], bucket_bytes: int = 256) -> Plan:
    return build_plan(wire_specs([TensorMeta(n, tuple(t.shape), t.dtype) for n, t in named.items()]), bucket_bytes)


def test_handles_travel_as_plain_bytes_and_only_on_a_cudaipc_link():
    shared = Shared((handle(b"h" * 64),), (DirectTensor(0, 0, 8, (4, 1)),), (0, 2))
    ring = DeviceRing((handle(b"r" * 64, size=128),), 128)
    for message in (shared, ring):
        encoded = encode(message)
        assert b"pickle" not in encoded and b"\x80\x05" not in encoded
        assert decode(encoded, get_transport("cudaipc").messages) == message
        with pytest.raises(ProtocolError, match="malformed"):
            decode(encoded, get_transport("shm").messages)


def test_a_storage_is_shared_once_and_again_only_when_it_changes(monkeypatch):
    shared: list[int] = []

    def fake_share(storage: torch.UntypedStorage) -> CudaHandle:
        shared.append(storage.data_ptr())
        return handle(str(storage.data_ptr()).encode(), size=storage.nbytes())

    monkeypatch.setattr(cudaipc, "share_storage", fake_share)
    shares = SharedStorages()
    weight = torch.zeros(8)
    first = shares.handle(weight.untyped_storage())
    weight.add_(1)  # an update in place: the same storage
    assert shares.handle(weight.untyped_storage()) == first and len(shared) == 1
    weight.data = torch.ones(8)  # a new storage: shared again, under another key
    second = shares.handle(weight.untyped_storage())
    assert second is not None and second.key != first.key and len(shared) == 2
    shares.keep([weight.untyped_storage()])  # the old one is let go
    assert shares.handle(weight.untyped_storage()) == second and len(shared) == 2


def test_a_storage_cuda_ipc_cannot_share_goes_through_the_ring(monkeypatch):
    def refuse(storage: torch.UntypedStorage) -> CudaHandle:
        raise RuntimeError("Attempted to send CUDA tensor received from another process")

    monkeypatch.setattr(cudaipc, "share_storage", refuse)
    assert SharedStorages().handle(torch.zeros(2).untyped_storage()) is None


def test_only_held_dense_device_tensors_as_planned_are_read_in_place(monkeypatch):
    monkeypatch.setattr(cudaipc, "share_storage", lambda s: handle(str(s.data_ptr()).encode(), size=s.nbytes()))
    embed = torch.zeros(16, 8)
    named = {
        "embed": embed,
        "head": embed,
        "norm": torch.zeros(8),
        "empty": torch.zeros(0, 3),
        "q": torch.ones(4, 6).t(),
    }
    plan = plan_of(named, bucket_bytes=128)
    # on the CPU (as for a host source) nothing is read in place: every tensor takes the ring
    assert share_tensors(plan, list(named.values()), SharedStorages()) == Shared((), (), ())
    # a source that does not hold its tensors shares nothing either
    assert share_tensors(plan, [], SharedStorages()) == Shared((), (), ())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    shared = share_tensors(plan, list(named.values()), SharedStorages())
    assert [entry.tensor for entry in shared.tensors] == [0, 1, 2, 4], "an empty tensor has nothing to read"
    assert len(shared.storages) == 3, "tied tensors share one storage, shared once"
    assert shared.tensors[3].stride == (1, 6), "a transposed tensor is read with its own strides"
    empty_bucket = next(k for k, bucket in enumerate(plan.buckets) if any(p.tensor == 3 for p in bucket))
    assert empty_bucket not in shared.buckets
    assert set(shared.buckets) == set(range(len(plan.buckets))) - {empty_bucket}


@pytest.mark.parametrize(
    ("entry", "storage_bytes"),
    [
        (DirectTensor(0, 0, 0, (8, 1)), 4 * 64 - 4),  # one element past its storage
        (DirectTensor(0, 0, 1, (8, 1)), 4 * 64),  # offset pushes it out
        (DirectTensor(0, 0, 0, (8, -1)), 4 * 64),  # a negative stride
        (DirectTensor(0, 0, 0, (8,)), 4 * 64),  # strides that do not match the shape
    ],
)
def test_a_view_outside_its_storage_is_refused(entry, storage_bytes):
    spec = plan_of({"w": torch.zeros(8, 8)}).tensors[0]
    check_view(spec, DirectTensor(0, 0, 0, (8, 1)), 4 * 64)
    with pytest.raises(ProtocolError, match="outside its storage"):
        check_view(spec, entry, storage_bytes)


def test_buckets_said_to_hold_in_place_tensors_only_are_checked():
    plan = plan_of({"a": torch.zeros(64), "b": torch.zeros(64)}, bucket_bytes=256)
    assert check_quiet([0], plan, frozenset({0})) == {0}
    with pytest.raises(ProtocolError, match="bucket 1"):
        check_quiet([1], plan, frozenset({0}))
    with pytest.raises(ProtocolError, match="bucket 7"):
        check_quiet([7], plan, frozenset({0, 1}))


def test_a_receiver_opens_each_storage_once_and_lets_go_of_what_the_sender_no_longer_names(monkeypatch):
    storages = {b"a": torch.arange(32, dtype=torch.float32).untyped_storage(), b"b": torch.ones(8).untyped_storage()}
    opened: list[bytes] = []

    def fake_open(shared: CudaHandle) -> torch.UntypedStorage:
        opened.append(shared.handle)
        return storages[shared.handle]

    monkeypatch.setattr(cudaipc, "open_storage", fake_open)
    plan = plan_of({"w": torch.zeros(4, 4), "v": torch.zeros(8)})
    a, b = handle(b"a", size=128), handle(b"b", size=32)
    cache = OpenedStorages()
    first = cache.views(Shared((a,), (DirectTensor(0, 0, 16, (1, 4)),), ()), plan)
    again = cache.views(Shared((a,), (DirectTensor(0, 0, 16, (1, 4)),), ()), plan)
    assert opened == [b"a"] and again[0][1] is first[0][1], "opened once, the view kept"
    assert torch.equal(first[0][1], torch.arange(16, 32, dtype=torch.float32).reshape(4, 4).t())
    cache.views(Shared((b,), (DirectTensor(1, 0, 0, (1,)),), ()), plan)
    cache.views(Shared((a,), (DirectTensor(0, 0, 16, (1, 4)),), ()), plan)
    assert opened == [b"a", b"b", b"a"], "a storage the sender stopped naming was let go"
    with pytest.raises(ProtocolError, match="twice"):
        cache.views(Shared((a,), (DirectTensor(0, 0, 0, (4, 1)), DirectTensor(0, 0, 16, (4, 1))), ()), plan)
    with pytest.raises(ProtocolError, match="outside the plan"):
        cache.views(Shared((a,), (DirectTensor(5, 0, 0, (4, 1)),), ()), plan)


def test_sources_say_whether_they_hold_their_tensors():
    named = {"w": torch.zeros(3)}
    assert held_tensors(StateDictSource(named)) == [named["w"]]
    assert held_tensors(ModuleSource(torch.nn.Linear(2, 2)))  # a plain module's own parameters

    class Generated:
        def metas(self) -> list[TensorMeta]:
            return [TensorMeta("w", (3,), torch.float32)]

        def tensors(self):  # type: ignore[no-untyped-def]
            yield "w", torch.zeros(3)

    assert held_tensors(Generated()) == []
