"""Landing, where each piece goes: lent to a borrowing loader without a copy, chunked tensors
assembled in an arena that is reused across syncs, owned tensors for a sink that keeps them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsync.landing import Landing, Staging
from weightsync.messages import Plan, TensorSpec
from weightsync.plan import arena_layout, build_plan, plan_id
from weightsync.sink import CallableSink, SinkTraits, WeightSink, as_sink

BUCKET = 4096


def plan_of(*sizes: int) -> Plan:
    """float32 tensors of `sizes` elements, in 4 KiB buckets (a tensor over 1024 elements is chunked)."""
    return build_plan([TensorSpec(f"t{i}", "float32", (n,), "float32") for i, n in enumerate(sizes)], BUCKET)


def ring_of(plan: Plan, values: dict[int, torch.Tensor]) -> list[np.ndarray]:
    """Each bucket's bytes as a transport would hold them (a ring slot per bucket)."""
    slots = [np.zeros(plan.bucket_bytes, dtype=np.uint8) for _ in plan.buckets]
    for index, bucket in enumerate(plan.buckets):
        for piece in bucket:
            source = values[piece.tensor].view(torch.uint8).numpy()
            slots[index][piece.bucket_offset : piece.bucket_offset + piece.nbytes] = source[
                piece.tensor_offset : piece.tensor_offset + piece.nbytes
            ]
    return slots


def land(plan: Plan, sink: WeightSink, slots: list[np.ndarray], staging: Staging | None = None) -> None:
    landing = Landing(plan, sink, 1, plan_id(plan), staging=staging)
    for index, bucket in enumerate(plan.buckets):
        for piece in bucket:
            landing.copy_in(piece, slots[index][piece.bucket_offset : piece.bucket_offset + piece.nbytes])
        landing.finish_bucket(index)


def test_a_borrowing_loader_gets_views_of_the_transport_buffer_and_chunked_tensors_from_the_arena() -> None:
    plan = plan_of(100, 3000, 200)  # t1 (12000 bytes) is chunked over four buckets
    values = {i: torch.randn(spec.shape[0]) for i, spec in enumerate(plan.tensors)}
    slots = ring_of(plan, values)
    staging = Staging()
    seen: dict[str, tuple[torch.Tensor, bool, int]] = {}

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            in_a_slot = any(np.shares_memory(tensor.numpy(), slot) for slot in slots)
            seen[name] = (tensor.clone(), in_a_slot, tensor.data_ptr())

    land(plan, CallableSink(load), slots, staging)
    for i, spec in enumerate(plan.tensors):
        assert torch.equal(seen[spec.name][0], values[i])
    assert seen["t0"][1] and seen["t2"][1], "a tensor whole in one bucket is lent, not copied"
    assert not seen["t1"][1], "a chunked tensor is assembled off the ring"
    first_arena_ptr = seen["t1"][2]
    land(plan, CallableSink(load), slots, staging)
    assert seen["t1"][2] == first_arena_ptr, "the arena is reused by the next sync"


def test_a_sink_that_keeps_its_tensors_gets_its_own() -> None:
    plan = plan_of(100, 3000)
    values = {i: torch.randn(spec.shape[0]) for i, spec in enumerate(plan.tensors)}
    slots = ring_of(plan, values)
    kept: dict[str, torch.Tensor] = {}

    class Keeps(WeightSink):
        traits = SinkTraits(borrows=False)

        def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
            kept.update(named)

    land(plan, Keeps(), slots)
    for slot in slots:
        slot[:] = 0  # the transport reuses its buffers
    for i, spec in enumerate(plan.tensors):
        assert torch.equal(kept[spec.name], values[i])


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ((3000,), 12032),  # one chunked tensor, 64-byte aligned
        ((100, 3000, 100, 3000), 24064),  # t1 ends in the bucket where t3 starts: both live at once
        ((3000, 1000, 3000), 12032),  # t0 is done before t2 begins: t2 reuses its place
    ],
)
def test_the_arena_holds_what_is_live_at_once(sizes: tuple[int, ...], expected: int) -> None:
    plan = plan_of(*sizes)
    chunked = [i for i, n in enumerate(sizes) if n * 4 > BUCKET]
    offsets, size = arena_layout(plan, chunked)
    assert size == expected
    spans = {t: (offsets[t], offsets[t] + plan.tensors[t].shape[0] * 4) for t in chunked}
    for a in chunked:
        for b in chunked:
            buckets_a = {i for i, bucket in enumerate(plan.buckets) for p in bucket if p.tensor == a}
            buckets_b = {i for i, bucket in enumerate(plan.buckets) for p in bucket if p.tensor == b}
            if a < b and buckets_a & buckets_b:
                assert spans[a][1] <= spans[b][0] or spans[b][1] <= spans[a][0], "live tensors never overlap"


def test_each_tensor_s_route_is_decided_once_at_begin() -> None:
    plan = plan_of(100, 3000, 200, 100, 3000)  # t1 and t4 are chunked
    dest = {"t0": torch.zeros(100), "t3": torch.zeros(200)[::2]}  # t3's destination is not contiguous

    class Borrows(WeightSink):
        def destination(self, name: str) -> torch.Tensor | None:
            return dest.get(name)

    class Keeps(Borrows):
        traits = SinkTraits(borrows=False)

    borrows = Landing(plan, Borrows(), 1, plan_id(plan))
    assert borrows.routes == ("host", "arena", "lent", "lent", "arena")
    assert borrows.lends_chunked and not borrows.patchable
    assert [site is not None for site in borrows.sites()] == [True, False, False, False, False]
    keeps = Landing(plan, Keeps(), 1, plan_id(plan))
    assert keeps.routes == ("host", "own", "own", "own", "own")
    assert not keeps.lends_chunked


def test_a_tensor_read_whole_from_the_sender_is_cast_on_the_way_into_each_route() -> None:
    """`copy_tensors` (cudaipc's direct path): the sender's fp32 tensor, with its own strides,
    lands as bf16 in a destination, or is lent to a borrowing loader, chunked or not."""
    specs = [TensorSpec("small", "bfloat16", (10, 10), "float32"), TensorSpec("big", "bfloat16", (40, 60), "float32")]
    plan = build_plan(specs, BUCKET)  # "big" (4800 bytes as sent) spans two buckets
    values = [torch.randn(10, 10).t(), torch.randn(60, 40).t()]
    expected = {spec.name: value.to(torch.bfloat16) for spec, value in zip(specs, values, strict=True)}

    dest = {spec.name: torch.zeros(spec.shape, dtype=torch.bfloat16) for spec in specs}
    loaded: dict[str, torch.Tensor] = {}
    for sink in (dest, CallableSink(lambda named: loaded.update((n, t.clone()) for n, t in named))):
        landing = Landing(plan, as_sink(sink), 1, plan_id(plan))
        assert landing.copy_tensors(list(enumerate(values))) == set(), "host memory: nothing left in flight"
        for index in range(len(plan.buckets)):
            landing.finish_bucket(index)
    assert all(torch.equal(dest[name], value) for name, value in expected.items())
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[n], v) for n, v in expected.items())


def test_a_one_element_tensor_with_a_stride_is_lent_whole() -> None:
    """torch calls x[::2][:1] contiguous with stride 2; its bytes are still lent (a GPU run
    failed here: "self.stride(-1) must be 1 to view Long as Byte")."""
    plan = build_plan([TensorSpec("step", "int64", (1,), "int64")], BUCKET)
    value = torch.arange(4, dtype=torch.int64)[1::2][:1]
    loaded: dict[str, torch.Tensor] = {}
    landing = Landing(
        plan, CallableSink(lambda named: loaded.update((n, t.clone()) for n, t in named)), 1, plan_id(plan)
    )
    landing.copy_tensors([(0, value)])
    landing.finish_bucket(0)
    assert torch.equal(loaded["step"], value)
