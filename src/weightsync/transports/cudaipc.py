"""CUDA IPC transport: same GPU (or GPUs that can reach each other), different processes.

The ring protocol (ring.py) with its slots in GPU memory: the sender makes `num_slots` slots on
its current CUDA device, shares each once by CUDA IPC (the handle travels as plain bytes in
`DeviceRing`), packs bucket k into slot k % num_slots with device-to-device copies, and every
receiver copies it straight into its destination tensors, device to device. Nothing crosses the
host: this is the transport for a trainer and a rollout engine that share a GPU in separate
processes (colocated RL). Control messages, acks and failure handling are shm's (one Unix socket
per receiver, `cudaipc://@NAME`).

Both sides synchronize their device around each bucket: the sender before it announces a bucket,
a receiver before it frees the slot. A receiver's destinations may also be in host memory (then
it copies device to host), but the ring is always on a GPU, so both processes need CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import torch

from weightsync.errors import ConfigError, ProtocolError
from weightsync.landing import Landing
from weightsync.messages import Message, Piece
from weightsync.pack import BucketItem, pack_bucket
from weightsync.transports.base import PlaneOptions, TransportSpec
from weightsync.transports.ring import RingReceivePlane, RingSendPlane, check_ring

__all__ = ["DeviceSlot", "DeviceRing", "SPEC", "DeviceRingSlots", "OpenedRing"]


class DeviceSlot(msgspec.Struct, frozen=True):
    """One GPU ring slot as CUDA IPC shares it (the fields of torch's `_share_cuda_`): plain
    bytes and numbers, opened by the receiver with `_new_shared_cuda`."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class DeviceRing(Message, frozen=True):
    """Sender -> receiver (cudaipc only): the GPU memory slots buckets are written to."""

    slots: tuple[DeviceSlot, ...]
    slot_bytes: int


def require_cuda(role: str) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(f"the cudaipc transport needs CUDA on the {role}; torch sees no CUDA device here")


class DeviceRingSlots:
    """The sender's ring: `num_slots` uint8 tensors of `slot_bytes` on its current CUDA device."""

    def __init__(self, num_slots: int, slot_bytes: int, staging_bytes: int = 0) -> None:
        if staging_bytes:
            raise ValueError("a GPU ring has no staging area")
        self.slot_bytes = slot_bytes
        self.staging_bytes = 0
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]

    def announcement(self) -> Message:
        shared = []
        for slot in self.slots:
            device, handle, size, offset, counter, counter_offset, event, sync = slot.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            shared.append(DeviceSlot(device, handle, size, offset, counter, counter_offset, event, sync))
        return DeviceRing(tuple(shared), self.slot_bytes)

    def write(
        self, slot: int, items: Sequence[BucketItem], *, readback: bool, staged: Mapping[int, int]
    ) -> list[np.ndarray]:
        with torch.cuda.device(self.device):
            views = pack_bucket(items, self.slots[slot])
            torch.cuda.current_stream().synchronize()  # the receivers read the slot from other processes
        return [torch.as_tensor(view).cpu().numpy() for view in views] if readback else []

    def unlink(self) -> None:
        """Nothing to unlink: CUDA frees the memory once every process let go of it."""

    def close(self) -> None:
        self.slots = []


class OpenedRing:
    """A receiver's handles on a sender's GPU ring."""

    def __init__(self, message: DeviceRing) -> None:
        self.slot_bytes = message.slot_bytes
        self.num_slots = len(message.slots)
        self.staging_bytes = 0
        self.slots: list[torch.Tensor] = []
        for slot in message.slots:
            storage = torch.UntypedStorage._new_shared_cuda(
                slot.device,
                slot.handle,
                slot.size,
                slot.offset,
                slot.ref_counter_handle,
                slot.ref_counter_offset,
                slot.event_handle,
                slot.event_sync_required,
            )
            self.slots.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
        self.device = self.slots[0].device if self.slots else None

    def read(self, slot: int, pieces: Sequence[Piece], landing: Landing, staged: Mapping[int, int]) -> None:
        out = self.slots[slot]
        devices = {self.device}
        with torch.cuda.device(self.device):
            for piece in pieces:
                landing.copy_in(piece, out[piece.bucket_offset : piece.bucket_offset + piece.nbytes])
                target = landing.target(piece)
                if isinstance(target, torch.Tensor):
                    devices.add(target.device)
        for device in devices:  # the sender may overwrite the slot once we ack it
            torch.cuda.synchronize(device)

    def close(self) -> None:
        self.slots = []


def open_ring(message: Message, options: PlaneOptions) -> OpenedRing | None:
    """Open the GPU ring `message` announces, or None when it announces none."""
    if not isinstance(message, DeviceRing):
        return None
    check_ring(len(message.slots), message.slot_bytes, options, "cudaipc")
    if any(
        slot.size != message.slot_bytes or not 0 <= slot.device < torch.cuda.device_count() for slot in message.slots
    ):
        raise ProtocolError("ring slots do not match its slot size or name no device here", transport="cudaipc")
    try:
        return OpenedRing(message)
    except RuntimeError as exc:
        raise ProtocolError(f"cannot open the sender's GPU ring: {str(exc)[:200]}", transport="cudaipc") from exc


SPEC = TransportSpec(
    name="cudaipc",
    link="unix",
    send_plane=lambda channel, options: RingSendPlane(channel, options, DeviceRingSlots),
    receive_plane=lambda link, options: RingReceivePlane(link, options, open_ring),
    messages=(DeviceRing,),
    needs_cuda=True,
    check=require_cuda,
)
