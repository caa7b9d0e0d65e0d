"""CUDA IPC transport: same GPU (or GPUs that can reach each other), different processes.

The shm transport with its ring in GPU memory: the sender owns a ring of slots on its current CUDA
device, shares each slot once with CUDA IPC (the handle travels as plain bytes in `DeviceRing`),
packs bucket k into slot k % num_slots with device-to-device copies, and every receiver copies it
straight into its destination tensors, device to device. Nothing crosses the host: this is the
transport for a trainer and a rollout engine that share a GPU in separate processes (colocated
RL). Control messages, acks, versions and failure handling are exactly shm's (one Unix socket per
receiver, `cudaipc://@NAME`).

Both sides synchronize their device around each bucket: the sender before it announces a bucket,
a receiver before it frees the slot. A receiver's destinations may also be in host memory (then
it copies device to host), but the ring is always on a GPU, so both processes need CUDA.
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync.errors import ConfigError, ProtocolError
from weightsync.pack import write_piece
from weightsync.sink import Landing
from weightsync.transports.base import BucketItem, Peer
from weightsync.transports.shm import ShmReceiver, ShmSender
from weightsync.types import DeviceRing, DeviceSlot, Message, Piece
from weightsync.wire import Connection

__all__ = ["CudaIpcReceiver", "CudaIpcSender"]


def _require_cuda(role: str) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(f"the cudaipc transport needs CUDA on the {role}; torch sees no CUDA device here")


class DeviceRingSlots:
    """The sender's ring: `num_slots` uint8 tensors of `slot_bytes` on one CUDA device."""

    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device) -> None:
        self.slot_bytes = slot_bytes
        self.device = device
        self.members: set[Connection] = set()
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]

    def announcement(self) -> Message:
        shared = []
        for slot in self.slots:
            device, handle, size, offset, counter, counter_offset, event, sync = slot.untyped_storage()._share_cuda_()
            shared.append(DeviceSlot(device, handle, size, offset, counter, counter_offset, event, sync))
        return DeviceRing(tuple(shared), self.slot_bytes)

    def write(self, slot: int, items: list[BucketItem], *, readback: bool) -> list[np.ndarray]:
        out = self.slots[slot]
        views = [out[item.piece.bucket_offset : item.piece.bucket_offset + item.piece.nbytes] for item in items]
        with torch.cuda.device(self.device):
            for item, view in zip(items, views, strict=True):
                write_piece(item.tensor, item.wire_dtype, item.piece.tensor_offset, item.piece.nbytes, view)
            torch.cuda.current_stream().synchronize()  # the receivers read the slot from other processes
        return [view.cpu().numpy() for view in views] if readback else []

    def unlink(self) -> None:
        """Nothing to unlink: CUDA frees the memory once every process let go of it."""

    def close(self) -> None:
        self.slots = []


class CudaIpcSender(ShmSender):
    name = "cudaipc"

    def __init__(self, peers: list[Peer], timeout: float, num_slots: int = 2, auth_token: str | None = None) -> None:
        _require_cuda("sender")
        super().__init__(peers, timeout, num_slots, auth_token)

    def new_ring(self, slot_bytes: int) -> DeviceRingSlots:  # type: ignore[override]
        return DeviceRingSlots(self.num_slots, slot_bytes, torch.device("cuda", torch.cuda.current_device()))


class _OpenedRing:
    """A receiver's handles on a sender's GPU ring."""

    def __init__(self, message: DeviceRing) -> None:
        self.slot_bytes = message.slot_bytes
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

    def read(self, slot: int, pieces: list[Piece], landing: Landing) -> None:
        out = self.slots[slot]
        devices = {self.device}
        with torch.cuda.device(self.device):
            for piece in pieces:
                landing.land_tensor(piece, out[piece.bucket_offset : piece.bucket_offset + piece.nbytes])
                if landing.on_device(piece.tensor):
                    devices.add(landing.device_target(piece).device)
        for device in devices:  # the sender may overwrite the slot once we ack it
            torch.cuda.synchronize(device)

    def close(self) -> None:
        self.slots = []


class CudaIpcReceiver(ShmReceiver):
    name = "cudaipc"

    def __init__(self, target, *, host: str, port: int, timeout: float) -> None:  # type: ignore[no-untyped-def]
        _require_cuda("receiver")
        super().__init__(target, host=host, port=port, timeout=timeout)

    def on_setup(self, conn: Connection, message: Message) -> bool:
        if not isinstance(message, DeviceRing):
            return False
        self.check_ring(len(message.slots), message.slot_bytes)
        if any(
            slot.size != message.slot_bytes or not 0 <= slot.device < torch.cuda.device_count()
            for slot in message.slots
        ):
            raise ProtocolError("ring slots do not match its slot size or name no device here", transport=self.name)
        self.on_disconnect(conn)
        try:
            self._rings[conn] = _OpenedRing(message)
        except RuntimeError as exc:
            raise ProtocolError(f"cannot open the sender's GPU ring: {str(exc)[:200]}", transport=self.name) from exc
        return True
