"""CUDA IPC transport: same GPU (or GPUs that can reach each other), different processes.

Two ways bytes move, both device to device, never through the host (colocated RL: a trainer and
rollout engines sharing a GPU in separate processes):

- **direct**: a tensor the source holds for the whole push (`source.holds_tensors`: a state
  dict, a model's own parameters, updated in place) is not copied by the sender at all. Its
  storage is shared once by CUDA IPC (`SharedStorages`: shared again only when the tensor's
  storage changes), the handles travel as plain bytes in `Shared` before the offer, and every
  receiver keeps what it opened (`OpenedStorages`, keyed by the handle) and copies straight from
  the sender's memory into its destination each sync: one device copy per byte, cast on the
  device. A bucket of such tensors only needs no ring slot and, unless the sync verifies, no
  message at all.
- **ring**: everything else (tensors generated per push, patches, host tensors) takes the ring
  protocol (ring.py) with its slots in GPU memory: the sender shares `num_slots` slots once,
  packs bucket k into slot k % num_slots, and every receiver copies it out. The ring is made only
  for a plan that has such a bucket.

Control messages, acks and failure handling are shm's (one Unix socket per receiver,
`cudaipc://@NAME`). The sender synchronises its devices before it shares a sync's tensors and
before it announces each ring bucket; a receiver synchronises before it frees a slot and before
it commits (the sender may change its tensors once the push returns). A receiver's destinations
may be in host memory (device to host copies), but both processes need CUDA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import torch

from weightsync.checksum import SyncHashes
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, ProtocolError
from weightsync.landing import Landing
from weightsync.messages import BucketReady, Message, Piece, Plan, TensorSpec
from weightsync.pack import BucketItem, pack_bucket, write_piece
from weightsync.transports.base import (
    Channel,
    Failures,
    Link,
    PlaneOptions,
    ReceivePlane,
    SendPlane,
    TransportSpec,
)
from weightsync.transports.control import expect_on
from weightsync.transports.ring import RingReceivePlane, RingSendPlane, check_ring

__all__ = [
    "SPEC",
    "CudaHandle",
    "DeviceReceivePlane",
    "DeviceRing",
    "DeviceRingSlots",
    "DeviceSendPlane",
    "DirectTensor",
    "OpenedRing",
    "OpenedStorages",
    "Shared",
    "SharedStorages",
]


class CudaHandle(msgspec.Struct, frozen=True):
    """A CUDA storage as CUDA IPC shares it (the fields of torch's `_share_cuda_`): plain bytes
    and numbers, opened by a receiver with `_new_shared_cuda`."""

    device: int
    handle: bytes
    """The IPC handle of the allocation the storage lies in."""
    size: int
    """The storage's bytes."""
    offset: int
    """The storage's byte offset in that allocation."""
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @property
    def key(self) -> tuple[int, bytes, int, int]:
        """What names the memory: a storage shared again (changed) comes under another key."""
        return (self.device, self.handle, self.offset, self.size)


class DeviceRing(Message, frozen=True):
    """Sender -> receiver (cudaipc only): the GPU memory slots buckets are written to."""

    slots: tuple[CudaHandle, ...]
    slot_bytes: int


class DirectTensor(msgspec.Struct, frozen=True, array_like=True):
    """A tensor of the plan that receivers copy from where it is: a view of a shared storage
    in the tensor's source dtype (`TensorSpec.source_dtype`) and the plan's shape."""

    tensor: int
    """Its index in the plan."""
    storage: int
    """Its storage: an index into `Shared.storages`."""
    storage_offset: int
    """In elements of its source dtype."""
    stride: tuple[int, ...]


class Shared(Message, frozen=True):
    """Sender -> receiver (cudaipc only), before each offer: the plan's tensors this sync reads
    straight from the sender's GPU memory, and the buckets that hold nothing else."""

    storages: tuple[CudaHandle, ...]
    tensors: tuple[DirectTensor, ...]
    buckets: tuple[int, ...]
    """Buckets of these tensors only: no ring slot; their `BucketReady` (slot -1, carrying the
    checksum) comes only where the sync verifies."""


NOTHING_SHARED = Shared((), (), ())


@dataclasses.dataclass(slots=True)
class InPlace:
    """This sync's tensors read in place, shared by a device plane with its ring, which then
    neither packs nor reads their pieces."""

    tensors: frozenset[int] = frozenset()


def require_cuda(role: str) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(f"the cudaipc transport needs CUDA on the {role}; torch sees no CUDA device here")


def share_storage(storage: torch.UntypedStorage) -> CudaHandle:
    """Share `storage` by CUDA IPC (once per storage: each call adds a reference count)."""
    return CudaHandle(*storage._share_cuda_())  # type: ignore[no-untyped-call]


def open_storage(handle: CudaHandle) -> torch.UntypedStorage:
    """Open a storage another process shared; ProtocolError if CUDA refuses the handle."""
    if not 0 <= handle.device < torch.cuda.device_count():
        raise ProtocolError(f"a shared storage names CUDA device {handle.device}, absent here", transport="cudaipc")
    try:
        return torch.UntypedStorage._new_shared_cuda(
            handle.device,
            handle.handle,
            handle.size,
            handle.offset,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
    except RuntimeError as exc:
        raise ProtocolError(f"cannot open the sender's GPU memory: {str(exc)[:200]}", transport="cudaipc") from exc


# --- the direct path: the sender's side ----------------------------------------------------------


class SharedStorages:
    """The sender's storages shared by CUDA IPC: each shared once and referenced here, so that
    its memory cannot be reused while receivers may read it, until a sync no longer names it."""

    def __init__(self) -> None:
        self._shared: dict[int, tuple[torch.UntypedStorage, CudaHandle]] = {}

    def handle(self, storage: torch.UntypedStorage) -> CudaHandle | None:
        """`storage`'s handle, shared now if it was not; None where CUDA IPC cannot share it (a
        storage this process itself opened from another)."""
        entry = self._shared.get(storage._cdata)
        if entry is not None:
            return entry[1]
        try:
            handle = share_storage(storage)
        except RuntimeError:
            return None
        self._shared[storage._cdata] = (storage, handle)
        return handle

    def keep(self, storages: Sequence[torch.UntypedStorage]) -> None:
        """Let go of every storage but `storages` (this sync's)."""
        wanted = {storage._cdata for storage in storages}
        self._shared = {key: entry for key, entry in self._shared.items() if key in wanted}

    def clear(self) -> None:
        self._shared = {}


def readable_in_place(spec: TensorSpec, tensor: torch.Tensor) -> bool:
    """Whether receivers may copy `tensor` from where it is: a dense CUDA tensor with bytes, as
    the plan describes it."""
    return (
        spec.encoding == "dense"
        and tensor.is_cuda
        and tensor.layout == torch.strided
        and tensor.numel() > 0
        and tuple(tensor.shape) == spec.shape
        and tensor.dtype == dtype_from_name(spec.source_dtype)
    )


def share_tensors(plan: Plan, held: Sequence[torch.Tensor], shares: SharedStorages) -> Shared:
    """The `Shared` of a sync of `plan` whose source holds `held`: every tensor receivers can
    read in place, its storage shared once (`shares`, which keeps only this sync's)."""
    if len(held) != len(plan.tensors):
        shares.clear()
        return NOTHING_SHARED
    positions: dict[tuple[int, bytes, int, int], int] = {}
    handles: list[CudaHandle] = []
    storages: list[torch.UntypedStorage] = []
    tensors: list[DirectTensor] = []
    for index, (spec, tensor) in enumerate(zip(plan.tensors, held, strict=True)):
        if not readable_in_place(spec, tensor):
            continue
        storage = tensor.untyped_storage()
        handle = shares.handle(storage)
        if handle is None:
            continue
        position = positions.setdefault(handle.key, len(handles))
        if position == len(handles):
            handles.append(handle)
        storages.append(storage)
        tensors.append(DirectTensor(index, position, int(tensor.storage_offset()), tuple(tensor.stride())))
    shares.keep(storages)
    direct = {entry.tensor for entry in tensors}
    buckets = tuple(k for k, bucket in enumerate(plan.buckets) if all(piece.tensor in direct for piece in bucket))
    return Shared(tuple(handles), tuple(tensors), buckets)


def read_back(item: BucketItem) -> np.ndarray:
    """The piece's bytes as sent (cast to the wire dtype), in host memory: for checksums."""
    out = np.empty(item.piece.nbytes, dtype=np.uint8)
    write_piece(item.tensor, item.wire_dtype, item.piece.tensor_offset, item.piece.nbytes, out)
    return out


class DeviceSendPlane(SendPlane):
    """Tensors the source holds are read in place by the receivers (`Shared`); the rest go
    through a GPU ring (`RingSendPlane` over `DeviceRingSlots`), made when a plan needs it."""

    reads_held = True

    def __init__(self, channel: Channel, options: PlaneOptions) -> None:
        super().__init__(channel, options)
        self._in_place = InPlace()
        self._ring = RingSendPlane(
            channel, options, lambda num_slots, slot_bytes, _: DeviceRingSlots(num_slots, slot_bytes, self._in_place)
        )
        self._shares = SharedStorages()
        self._quiet: frozenset[int] = frozenset()
        """This sync's buckets of in-place tensors only."""

    def prepare(self, plan: Plan, live: Sequence[str], held: Sequence[torch.Tensor] = ()) -> Failures:
        shared = share_tensors(plan, held, self._shares)
        self._in_place.tensors = frozenset(entry.tensor for entry in shared.tensors)
        self._quiet = frozenset(shared.buckets)
        for device in {held[entry.tensor].device for entry in shared.tensors}:
            torch.cuda.synchronize(device)  # the source's last writes land before any receiver reads
        failures = self._ring.prepare(plan, live) if len(self._quiet) < len(plan.buckets) else {}
        ready = [address for address in live if address not in failures]
        return failures | self.channel.each(ready, lambda address, link: link.send(shared, self.options.timeout))

    def begin(self, plan: Plan, accepted: Sequence[str]) -> Failures:
        return self._ring.begin(plan, accepted)

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        if index not in self._quiet:
            return self._ring.send(index, items, live, hashes)
        if hashes is None:
            return {}  # the receivers read its tensors when the sync began
        message = BucketReady(index, hashes.bucket([item.piece for item in items], [read_back(i) for i in items]))
        return self.channel.each(live, lambda address, link: link.send(message, self.options.timeout))

    def finish(self, live: Sequence[str]) -> Failures:
        return self._ring.finish(live)

    def abort(self) -> None:
        self._ring.abort()

    def close(self) -> None:
        self._ring.close()
        self._shares.clear()


# --- the direct path: a receiver's side ----------------------------------------------------------


ViewKey = tuple[tuple[int, bytes, int, int], str, int, tuple[int, ...], tuple[int, ...]]
"""A view of a shared storage: the storage's key, dtype, storage offset, shape, stride."""


class OpenedStorages:
    """A receiver's views of a sender's tensors: each storage opened by CUDA IPC once, each view
    made once, both kept while the sender names them (a changed storage comes under another
    key, and the one it replaces is let go, so that the sender's memory can be freed)."""

    def __init__(self) -> None:
        self._storages: dict[tuple[int, bytes, int, int], torch.UntypedStorage] = {}
        self._views: dict[ViewKey, torch.Tensor] = {}

    def views(self, shared: Shared, plan: Plan) -> list[tuple[int, torch.Tensor]]:
        """Each tensor `shared` names, as a view of the sender's memory; ProtocolError for a
        tensor outside the plan or a view outside its storage."""
        storages = {handle.key: self._open(handle) for handle in shared.storages}
        views: dict[ViewKey, torch.Tensor] = {}
        found = []
        for entry in shared.tensors:
            key, view = self._view(entry, shared, plan, storages)
            views[key] = view
            found.append((entry.tensor, view))
        if len({tensor for tensor, _ in found}) != len(found):
            raise ProtocolError("the sender shares a tensor twice", transport="cudaipc")
        self._storages, self._views = storages, views
        return found

    def _open(self, handle: CudaHandle) -> torch.UntypedStorage:
        opened = self._storages.get(handle.key)
        return open_storage(handle) if opened is None else opened

    def _view(
        self,
        entry: DirectTensor,
        shared: Shared,
        plan: Plan,
        storages: Mapping[tuple[int, bytes, int, int], torch.UntypedStorage],
    ) -> tuple[ViewKey, torch.Tensor]:
        if not (0 <= entry.tensor < len(plan.tensors) and 0 <= entry.storage < len(shared.storages)):
            raise ProtocolError(f"the sender shares {entry!r}, outside the plan or its storages", transport="cudaipc")
        spec = plan.tensors[entry.tensor]
        handle = shared.storages[entry.storage]
        key: ViewKey = (handle.key, spec.source_dtype, entry.storage_offset, spec.shape, entry.stride)
        view = self._views.get(key)
        if view is None:
            storage = storages[handle.key]
            check_view(spec, entry, storage.nbytes())
            view = torch.empty(0, dtype=dtype_from_name(spec.source_dtype), device=storage.device)
            view.set_(storage, entry.storage_offset, spec.shape, entry.stride)
        return key, view

    def close(self) -> None:
        self._storages, self._views = {}, {}


def check_view(spec: TensorSpec, entry: DirectTensor, storage_bytes: int) -> None:
    """Refuse a view that is not a dense tensor of the plan lying wholly inside its storage."""
    itemsize = dtype_from_name(spec.source_dtype).itemsize
    last = entry.storage_offset + sum((size - 1) * step for size, step in zip(spec.shape, entry.stride, strict=False))
    if (
        spec.encoding != "dense"
        or len(entry.stride) != len(spec.shape)
        or min((entry.storage_offset, *entry.stride)) < 0
        or (last + 1) * itemsize > storage_bytes
    ):
        raise ProtocolError(
            f"the sender shares {spec.name!r} as a view outside its storage or as a patch", transport="cudaipc"
        )


class DeviceReceivePlane(ReceivePlane):
    """Lands the tensors the sender shares (`Shared`) when the sync begins, straight from its
    memory; the rest out of its GPU ring (`RingReceivePlane` over `OpenedRing`)."""

    def __init__(self, link: Link, options: PlaneOptions) -> None:
        super().__init__(link, options)
        self._in_place = InPlace()
        self._ring = RingReceivePlane(link, options, lambda message, opts: open_ring(message, opts, self._in_place))
        self._opened = OpenedStorages()
        self._shared = NOTHING_SHARED
        self._quiet: frozenset[int] = frozenset()
        self._devices: set[torch.device] = set()
        """Where this sync's direct copies run: synchronised before the commit."""

    def on_setup(self, message: Message) -> bool:
        if isinstance(message, Shared):
            self._shared = message
            return True
        return self._ring.on_setup(message)

    def begin(self, landing: Landing) -> None:
        self._ring.begin(landing)
        shared, self._shared = self._shared, NOTHING_SHARED
        views = self._opened.views(shared, landing.plan)
        self._in_place.tensors = frozenset(tensor for tensor, _ in views)
        self._quiet = frozenset(check_quiet(shared.buckets, landing.plan, self._in_place.tensors))
        self._devices = {view.device for _, view in views} | landing.copy_tensors(views)

    def receive(self, index: int, landing: Landing) -> None:
        if index not in self._quiet:
            self._ring.receive(index, landing)
            return
        if landing.verify == "off":
            landing.finish_bucket(index)
            return
        message = expect_on(self.link, BucketReady, self.options.timeout, f"BucketReady for bucket {index}")
        if message.index != index or message.slot != -1:
            raise ProtocolError(
                f"expected BucketReady for bucket {index} (no slot), got {message!r}"[:200],
                transport=self.link.transport,
                bucket=index,
            )
        landing.finish_bucket(index, message.checksum)

    def finish(self, landing: Landing) -> None:
        for device in self._devices:  # the sender may change its tensors once we commit
            torch.cuda.synchronize(device)
        self._ring.finish(landing)

    def close(self) -> None:
        self._ring.close()
        self._opened.close()


def check_quiet(buckets: Sequence[int], plan: Plan, in_place: frozenset[int]) -> set[int]:
    """The buckets the sender says hold in-place tensors only, checked: a bucket outside the
    plan, or one with another tensor's piece (which would never land), is refused."""
    quiet = set(buckets)
    for index in quiet:
        if not (0 <= index < len(plan.buckets) and all(piece.tensor in in_place for piece in plan.buckets[index])):
            raise ProtocolError(f"bucket {index} is not one of in-place tensors only", transport="cudaipc")
    return quiet


# --- the ring: everything else -------------------------------------------------------------------


class DeviceRingSlots:
    """The sender's ring: `num_slots` uint8 tensors of `slot_bytes` on its current CUDA device.
    Pieces of the sync's in-place tensors (`in_place`) are not packed: receivers read them."""

    def __init__(self, num_slots: int, slot_bytes: int, in_place: InPlace) -> None:
        self.slot_bytes = slot_bytes
        self.staging_bytes = 0
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]
        self._in_place = in_place

    def announcement(self) -> Message:
        return DeviceRing(tuple(share_storage(slot.untyped_storage()) for slot in self.slots), self.slot_bytes)

    def write(
        self, slot: int, items: Sequence[BucketItem], *, readback: bool, staged: Mapping[int, int]
    ) -> list[np.ndarray]:
        in_place = self._in_place.tensors
        with torch.cuda.device(self.device):
            views = iter(pack_bucket([item for item in items if item.piece.tensor not in in_place], self.slots[slot]))
            torch.cuda.current_stream().synchronize()  # the receivers read the slot from other processes
        if not readback:
            return []
        return [
            read_back(item) if item.piece.tensor in in_place else torch.as_tensor(next(views)).cpu().numpy()
            for item in items
        ]

    def unlink(self) -> None:
        """Nothing to unlink: CUDA frees the memory once every process let go of it."""

    def close(self) -> None:
        self.slots = []


class OpenedRing:
    """A receiver's handles on a sender's GPU ring; pieces of in-place tensors are skipped (they
    landed when the sync began)."""

    def __init__(self, message: DeviceRing, in_place: InPlace) -> None:
        self.slot_bytes = message.slot_bytes
        self.num_slots = len(message.slots)
        self.staging_bytes = 0
        self.slots = [
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            for storage in (open_storage(slot) for slot in message.slots)
        ]
        self.device = self.slots[0].device if self.slots else None
        self._in_place = in_place

    def read(self, slot: int, pieces: Sequence[Piece], landing: Landing, staged: Mapping[int, int]) -> None:
        out = self.slots[slot]
        devices = {self.device}
        in_place = self._in_place.tensors
        with torch.cuda.device(self.device):
            for piece in pieces:
                if piece.tensor in in_place:
                    continue
                landing.copy_in(piece, out[piece.bucket_offset : piece.bucket_offset + piece.nbytes])
                target = landing.target(piece)
                if isinstance(target, torch.Tensor):
                    devices.add(target.device)
        for device in devices:  # the sender may overwrite the slot once we ack it
            torch.cuda.synchronize(device)

    def close(self) -> None:
        self.slots = []


def open_ring(message: Message, options: PlaneOptions, in_place: InPlace) -> OpenedRing | None:
    """Open the GPU ring `message` announces, or None when it announces none."""
    if not isinstance(message, DeviceRing):
        return None
    check_ring(len(message.slots), message.slot_bytes, options, "cudaipc")
    if any(slot.size != message.slot_bytes for slot in message.slots):
        raise ProtocolError("ring slots do not match its slot size", transport="cudaipc")
    return OpenedRing(message, in_place)


SPEC = TransportSpec(
    name="cudaipc",
    link="unix",
    send_plane=DeviceSendPlane,
    receive_plane=DeviceReceivePlane,
    messages=(DeviceRing, Shared),
    needs_cuda=True,
    check=require_cuda,
)
