"""The shm ring's staging area: a tensor larger than a bucket is written there whole, so a loader
is lent it from the sender's segment (no copy assembled on the receiver) and a destination
copies each piece out as before. Its space is reused only when the ring's acks have freed it."""

from __future__ import annotations

import mmap
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_all_bit_exact, random_tensor, receiving, sending
from weightsync.errors import ProtocolError
from weightsync.landing import Landing
from weightsync.messages import Message, Plan, TensorSpec
from weightsync.plan import build_plan, plan_id
from weightsync.sink import CallableSink
from weightsync.transports.base import PlaneOptions
from weightsync.transports.ring import RingReceivePlane, Staged, staging_layout
from weightsync.transports.shm import MappedRing

BUCKET = 4096


def plan_of(sizes: list[int]) -> Plan:
    return build_plan([TensorSpec(f"t{i}", "float32", (n,), "float32") for i, n in enumerate(sizes)], BUCKET)


def buckets_of(plan: Plan, tensor: int) -> list[int]:
    return [index for index, bucket in enumerate(plan.buckets) if any(p.tensor == tensor for p in bucket)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=12))
def test_staged_space_is_reused_only_after_every_receiver_acked_its_last_bucket(sizes: list[int]) -> None:
    plan = plan_of(sizes)
    layout = staging_layout(plan)
    chunked = {t for t in range(len(sizes)) if len(buckets_of(plan, t)) > 1}
    assert set(layout.offsets) == chunked, "exactly the tensors larger than a bucket are staged"
    for a in layout.offsets:
        for b in layout.offsets:
            if a >= b:
                continue
            a_start, b_start = layout.offsets[a], layout.offsets[b]
            a_end, b_end = a_start + sizes[a] * 4, b_start + sizes[b] * 4
            assert a_end <= layout.nbytes and b_end <= layout.nbytes
            if a_start < b_end and b_start < a_end:  # they share space: b is written once a is acked
                first_of_b, last_of_a = buckets_of(plan, b)[0], buckets_of(plan, a)[-1]
                assert first_of_b > last_of_a
                assert layout.frees[first_of_b] >= last_of_a


def _mapping(path_fragment: str, address: int) -> str | None:
    """The file behind `address` in this process's memory map, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def test_a_loader_is_lent_chunked_tensors_from_the_senders_staging_segment() -> None:
    source = {
        "embed": random_tensor(torch.float32, (3 * BUCKET // 4 + 17,), seed=1),  # over 3 buckets
        "small": random_tensor(torch.float32, (33,), seed=2),
        "head": random_tensor(torch.float32, (5 * BUCKET // 4,), seed=3),  # over 5
    }
    seen: dict[str, tuple[torch.Tensor, str | None]] = {}

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            seen[name] = (tensor.clone(), _mapping("weightsync-", tensor.data_ptr()))

    with receiving(CallableSink(load), "shm") as receiver, sending(receiver.address, bucket_bytes=BUCKET) as s:
        for version in range(4):
            source = {name: t + 1 for name, t in source.items()}
            assert s.push(source, version).ok
            assert_all_bit_exact({name: tensor for name, (tensor, _) in seen.items()}, source)
            for name in ("embed", "head"):
                where = seen[name][1]
                if version == 0:  # the receiver's Accept tells the sender it lends: staged from the next sync
                    assert where is None or "weightsync-" not in where, where
                else:  # slots are segments 0 and 1, the staging area is 2
                    assert where is not None and where.split()[0].endswith("-2"), where
                    assert "/dev/shm/weightsync-" in where, where
                    assert receiver.buffer_bytes == 0, "the arena of the first sync was given back"


def test_receivers_with_destinations_cost_the_sender_no_staging_area() -> None:
    source = {"big": random_tensor(torch.float32, (3 * BUCKET // 4 + 17,), seed=1)}
    dest = {"big": torch.zeros_like(source["big"])}
    with receiving(dest, "shm") as receiver, sending(receiver.address, bucket_bytes=BUCKET) as s:
        for version in range(3):
            assert s.push(source, version).ok
        with open("/proc/self/maps") as maps:
            segments = set(re.findall(r"/dev/shm/weightsync-\d+-[0-9a-f]{12}-(\d+)", maps.read()))
        assert segments == {"0", "1"}, "two slots, no staging area"
    assert_all_bit_exact(dest, source)


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_chunked_tensors_reach_a_loader_and_a_destination_exact_when_staged_space_is_reused(num_slots: int) -> None:
    sizes = [2500, 40, 3000, 2100, 10, 2600, 2900, 700, 2300]  # most span 3 buckets: space is reused
    loaded: dict[str, torch.Tensor] = {}

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((name, tensor.clone()) for name, tensor in named)  # valid only for the call

    dest = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    with (
        receiving(CallableSink(load), "shm") as lender,
        receiving(dest, "shm") as copier,
        sending([lender.address, copier.address], bucket_bytes=BUCKET, num_slots=num_slots, verify="bucket") as s,
    ):
        for version in range(4):
            source = {f"t{i}": random_tensor(torch.float32, (n,), seed=10 * version + i) for i, n in enumerate(sizes)}
            assert s.push(source, version).ok
            assert_all_bit_exact(loaded, source)
            assert_all_bit_exact(dest, source)


class _Link:
    """A link whose sender has sent one message."""

    transport = "shm"

    def __init__(self, message: Message) -> None:
        self.message = message

    def recv(self, timeout: float | None, max_bytes: int = 0) -> Message:
        return self.message


@pytest.mark.parametrize("where", ["past the area", "no such tensor"])
def test_a_tensor_staged_outside_the_staging_area_is_refused(where: str) -> None:
    plan = plan_of([3000, 3000])
    layout = staging_layout(plan)
    slots = [mmap.mmap(-1, BUCKET) for _ in range(2)]
    ring = MappedRing(slots, mmap.mmap(-1, layout.nbytes))
    offsets = dict(layout.offsets)
    if where == "past the area":
        offsets[max(offsets)] += 64  # the sender's layout, one tensor shifted past the end
    else:
        offsets[len(plan.tensors)] = 0
    plane = RingReceivePlane(_Link(Staged(tuple(offsets.items()))), PlaneOptions(timeout=5.0), lambda m, o: ring)
    assert plane.on_setup(Staged(()))  # the ring "announced"
    landing = Landing(plan, CallableSink(lambda named: None), 1, plan_id(plan))
    with pytest.raises(ProtocolError, match="outside the plan or the ring's staging area"):
        plane.begin(landing)
    plane.close()
    assert np.asarray(ring.staging).size == 0
