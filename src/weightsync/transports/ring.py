"""The ring protocol, shared by shm (slots in host shared memory) and cudaipc (slots in GPU
memory): the sender owns `num_slots` slots, created once and reused across syncs, writes bucket
k into slot k % num_slots while receivers copy bucket k-1 out, and every receiver reads the same
slot (written once, read N times). A receiver acks each bucket (`BucketDone`) to free its slot.

A ring may also have a staging area (shm): a tensor larger than a bucket is written there
whole, piece by piece, rather than into the slots, so that a receiver whose sink borrows can be
lent it whole instead of assembling a copy of its own. The sender places them (`staging_layout`)
and tells each receiver where in a `Staged` at the start of the sync. A bucket wholly in the
staging area takes no slot, so the sender packs it while receivers are still busy with earlier
slots; before it writes into space an earlier tensor held, it waits for every ack of that
tensor's last bucket.

A ring is announced before the offer (`prepare`), so every receiver has mapped it before it
accepts, and unlinked right after (`begin`; `finish` or `abort` when the plan had no buckets or
failed first): a crash of either side leaves nothing behind. The rings themselves (how a
slot is made, shared, written and read) live in shm.py and cudaipc.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from weightsync.checksum import SyncHashes
from weightsync.errors import ConfigError, ProtocolError
from weightsync.landing import Landing
from weightsync.messages import BucketDone, BucketReady, Message, Piece, Plan
from weightsync.pack import BucketItem
from weightsync.plan import arena_layout, bucket_spans, tensor_nbytes
from weightsync.transports.base import Channel, Failures, Link, PlaneOptions, ReceivePlane, SendPlane
from weightsync.transports.control import expect_on

__all__ = [
    "MAX_SLOTS",
    "ReceiveRing",
    "RingReceivePlane",
    "RingSendPlane",
    "SendRing",
    "Staged",
    "StagingLayout",
    "staging_layout",
]

MAX_SLOTS = 16


class Staged(Message, frozen=True):
    """Sender -> receiver (a ring with a staging area), after `Accept`, before the buckets: where
    this sync's tensors larger than a bucket sit in the staging area."""

    offsets: tuple[tuple[int, int], ...]
    """(tensor index, byte offset in the staging area) of each staged tensor; () for none."""


class SendRing(Protocol):
    """The sender's slots."""

    slot_bytes: int
    staging_bytes: int
    """The staging area's size; 0 for a ring without one."""

    def announcement(self) -> Message:
        """What tells a receiver how to open this ring."""

    def write(
        self, slot: int, items: Sequence[BucketItem], *, readback: bool, staged: Mapping[int, int]
    ) -> list[np.ndarray]:
        """Pack `items` into slot `slot`, those of the tensors in `staged` into the staging area
        instead (at the tensor's offset there, `staging_layout`), ready for other processes to
        read; with `readback`, returns their bytes in host memory (for checksums)."""

    def unlink(self) -> None:
        """Remove the names others open the ring by; the slots stay usable."""

    def close(self) -> None: ...


class ReceiveRing(Protocol):
    """A receiver's view of a sender's slots."""

    slot_bytes: int
    num_slots: int
    staging_bytes: int
    """The staging area's size; 0 for a ring without one."""

    def read(self, slot: int, pieces: Sequence[Piece], landing: Landing, staged: Mapping[int, int]) -> None:
        """Land `pieces` out of slot `slot`, those of the tensors in `staged` out of the staging
        area (at the tensor's offset there); the slot may be overwritten once this returns."""

    def close(self) -> None: ...


class RingSendPlane(SendPlane):
    """Buckets through a ring; `new_ring(num_slots, slot_bytes, staging_bytes)` makes the ring.
    `stages`: tensors larger than a bucket go through the ring's staging area."""

    def __init__(
        self,
        channel: Channel,
        options: PlaneOptions,
        new_ring: Callable[[int, int, int], SendRing],
        *,
        stages: bool = False,
    ) -> None:
        super().__init__(channel, options)
        if not 1 <= options.num_slots <= MAX_SLOTS:
            raise ConfigError(f"num_slots must be in [1, {MAX_SLOTS}], got {options.num_slots}")
        self._new_ring = new_ring
        self._stages = stages
        self._ring: SendRing | None = None
        self._members: set[Link] = set()
        """The links that have opened the ring; a reconnected receiver needs a new ring."""
        self._staging = StagingLayout()
        """This sync's tensors in the staging area."""
        self._slot_users: list[int] = []
        """The last bucket written into each slot (-1: none this sync)."""
        self._slots_used = 0

    def prepare(self, plan: Plan, live: Sequence[str], held: Sequence[torch.Tensor] = ()) -> Failures:
        plan_bytes = plan.bucket_bytes
        self._slot_users, self._slots_used = [-1] * self.options.num_slots, 0
        staging = staging_layout(plan) if self._stages else StagingLayout()
        # a staging area costs memory: made only once a receiver said it would be lent from it;
        # a ring that has one uses it for every plan that fits (receivers rely on that)
        wanted = staging.nbytes > 0 and any(self.channel.lends(address) for address in live)
        links = {self.channel.link(address) for address in live}
        failures: Failures = {}
        ring = self._ring
        if (
            ring is None
            or ring.slot_bytes != plan_bytes
            or ring.staging_bytes < (staging.nbytes if wanted or ring.staging_bytes else 0)
            or not links <= self._members
        ):
            if ring is not None:
                ring.close()
            self._ring = ring = self._new_ring(self.options.num_slots, plan_bytes, staging.nbytes if wanted else 0)
            self._members = links
            message = ring.announcement()
            failures = self.channel.each(live, lambda address, link: link.send(message, self.options.timeout))
        self._staging = staging if ring.staging_bytes else StagingLayout()
        return failures

    def begin(self, plan: Plan, accepted: Sequence[str]) -> Failures:
        self._unlink()  # every receiver that accepted has opened the ring
        if self._ring is None or not self._ring.staging_bytes:
            return {}
        staged = Staged(tuple(self._staging.offsets.items()))
        return self.channel.each(accepted, lambda address, link: link.send(staged, self.options.timeout))

    def finish(self, live: Sequence[str]) -> Failures:
        self._unlink()  # a plan of no buckets has no `begin`
        return {}

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        ring = self._ring
        if ring is None:
            raise ProtocolError("bucket sent before the ring was set up", transport=self.channel.scheme)
        staged = self._staging.offsets
        after = self._staging.frees.get(index, -1)  # the staging space it writes into is free
        slot = 0
        if any(item.piece.tensor not in staged for item in items):  # and its slot is free
            slot = self._slots_used % self.options.num_slots
            self._slots_used += 1
            after = max(after, self._slot_users[slot])
            self._slot_users[slot] = index
        deadline = time.monotonic() + self.options.timeout
        failures = self.channel.each(live, lambda address, link: self.channel.wait_acked(address, after, deadline))
        views = ring.write(slot, items, readback=hashes is not None, staged=staged)
        checksum = hashes.bucket([item.piece for item in items], views) if hashes is not None else 0
        message = BucketReady(index, checksum, slot)
        ready = [address for address in live if address not in failures]
        return failures | self.channel.each(ready, lambda address, link: link.send(message, self.options.timeout))

    def abort(self) -> None:
        self._unlink()

    def _unlink(self) -> None:
        if self._ring is not None:
            self._ring.unlink()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None


class RingReceivePlane(ReceivePlane):
    """Buckets out of a sender's ring; `open_ring(message)` opens the ring a setup message
    announces, or returns None when the message is not a ring of this kind."""

    def __init__(
        self, link: Link, options: PlaneOptions, open_ring: Callable[[Message, PlaneOptions], ReceiveRing | None]
    ) -> None:
        super().__init__(link, options)
        self._open_ring = open_ring
        self._ring: ReceiveRing | None = None
        self._staged: dict[int, int] = {}
        """This sync's tensors in the ring's staging area, as the sender placed them."""

    def on_setup(self, message: Message) -> bool:
        ring = self._open_ring(message, self.options)
        if ring is None:
            return False
        self.close()
        self._ring = ring
        return True

    def begin(self, landing: Landing) -> None:
        """Take where the sender placed this sync's staged tensors (a ring with a staging area)."""
        ring, plan = self._ring, landing.plan
        self._staged = {}
        if ring is None or not ring.staging_bytes:
            return
        staged = dict(expect_on(self.link, Staged, self.options.timeout).offsets)
        for tensor, offset in staged.items():
            room = ring.staging_bytes - tensor_nbytes(plan.tensors[tensor]) if 0 <= tensor < len(plan.tensors) else -1
            if not 0 <= offset <= room:
                raise ProtocolError(
                    f"the sender stages tensor {tensor} at {offset}, outside the plan or the ring's staging area",
                    transport=self.link.transport,
                )
        self._staged = staged

    def receive(self, index: int, landing: Landing) -> None:
        message = expect_on(self.link, BucketReady, self.options.timeout, f"BucketReady for bucket {index}")
        ring = self._ring
        if message.index != index:
            raise ProtocolError(
                f"expected BucketReady for bucket {index}, got {message!r}"[:200],
                transport=self.link.transport,
                bucket=index,
            )
        if ring is None or not 0 <= message.slot < ring.num_slots or landing.plan.bucket_bytes > ring.slot_bytes:
            raise ProtocolError(
                "bucket refers to a ring slot this receiver has not mapped",
                transport=self.link.transport,
                bucket=index,
            )
        ring.read(message.slot, landing.plan.buckets[index], landing, self._staged)
        landing.finish_bucket(index, message.checksum)
        self.link.send(BucketDone(index), self.options.timeout)

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None


@dataclasses.dataclass(frozen=True, slots=True)
class StagingLayout:
    """A plan's tensors in a ring's staging area."""

    offsets: dict[int, int] = dataclasses.field(default_factory=dict)
    """Each staged tensor's offset in the area."""
    nbytes: int = 0
    """The area's size."""
    frees: dict[int, int] = dataclasses.field(default_factory=dict)
    """Bucket -> the bucket every receiver must have acked before it is written: the last of
    the earlier tensors whose space its staged tensors reuse."""


def staging_layout(plan: Plan) -> StagingLayout:
    """Where each tensor of `plan` larger than a bucket sits in a ring's staging area."""
    spans = bucket_spans(plan)
    chunked = sorted(tensor for tensor, (first, last) in spans.items() if last > first)
    offsets, nbytes = arena_layout(plan, chunked)
    frees: dict[int, int] = {}
    for i, tensor in enumerate(chunked):
        start, end = offsets[tensor], offsets[tensor] + tensor_nbytes(plan.tensors[tensor])
        first = spans[tensor][0]
        for earlier in chunked[:i]:
            if offsets[earlier] < end and start < offsets[earlier] + tensor_nbytes(plan.tensors[earlier]):
                frees[first] = max(frees.get(first, -1), spans[earlier][1])
    return StagingLayout(offsets, nbytes, frees)


def check_ring(num_slots: int, slot_bytes: int, options: PlaneOptions, transport: str) -> None:
    """Refuse a ring this receiver would not allocate buckets for, before opening any of it."""
    if not 0 < num_slots <= MAX_SLOTS or not 0 < slot_bytes <= options.max_bucket_bytes:
        raise ProtocolError(
            f"ring of {num_slots} x {slot_bytes} bytes exceeds this receiver's limits", transport=transport
        )
