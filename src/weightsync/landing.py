"""Landing: where each planned byte of one sync goes on the receiving side.

The mirror of `pack.py`. A data plane asks for a piece's landing site (`host_view` for host
memory, `device_view` for a device) or hands over the piece's bytes (`copy_in`, `read_in`), then
calls `finish_bucket`, which checks the bucket (when the sync verifies) and delivers the tensors
it completed. Where a tensor lands:

- a contiguous destination of the right shape and dtype: written in place, piece by piece (on a
  GPU too, straight from the transport's buffer);
- no destination, a sink that `borrows` (an engine's loader), and the tensor whole in one
  bucket: not copied at all. `load` gets a read-only view of the transport's buffer (a ring
  slot, a GPU slot, a reused receive buffer), valid for the call;
- no destination, chunked over several buckets, a borrowing sink, and a transport that holds
  the whole tensor in a buffer of its own (the shm ring's staging area): lent from there too;
- no destination, chunked over several buckets otherwise: assembled in the receiver's staging
  arena (`Staging`), allocated once, pre-faulted and reused across syncs;
- anything else (a sink that keeps what it is handed): a host tensor of its own.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import psutil
import torch
import xxhash

from weightsync.checksum import SyncHashes, Verify, content_digest, tensor_digests
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ChecksumError, PlanError
from weightsync.hostmem import host_bytes
from weightsync.hostpin import readable_tensor
from weightsync.messages import Piece, Plan
from weightsync.pack import byte_view, copy_bytes
from weightsync.patch import apply_patch
from weightsync.plan import bucket_spans, tensor_nbytes
from weightsync.sink import WeightSink, sink_errors

__all__ = ["Landing", "Staging"]

ALIGN = 64


class Staging:
    """A receiver's reusable landing space for tensors without a destination: an arena where
    chunked tensors are assembled, and a receive buffer of one bucket for transports that read
    from a socket. Both are allocated once, pre-faulted, and kept across syncs (a fresh buffer
    per sync would pay page faults every time: about 2 GB/s here, against 8 for a warm copy)."""

    def __init__(self) -> None:
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._receive = torch.empty(0, dtype=torch.uint8)

    def arena(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` of arena (grown, never shrunk; with an eighth to spare, since the
        patches of a delta sync, staged here, vary a little in size from sync to sync)."""
        if self._arena.numel() < nbytes:
            self._arena = _prefaulted(nbytes + nbytes // 8)
        return self._arena

    def release_arena(self) -> None:
        """Give the arena back (a sync found its tensors lent from a transport's own buffer)."""
        self._arena = torch.empty(0, dtype=torch.uint8)

    def receive_buffer(self, nbytes: int) -> np.ndarray:
        """At least `nbytes` of receive buffer (grown, never shrunk)."""
        if self._receive.numel() < nbytes:
            self._receive = _prefaulted(nbytes)
        return self._receive.numpy()

    @property
    def nbytes(self) -> int:
        """What it holds, in bytes."""
        return self._arena.numel() + self._receive.numel()


def _prefaulted(nbytes: int) -> torch.Tensor:
    buffer = host_bytes(nbytes)
    buffer.fill_(0)  # touch every page now, not during a sync
    return buffer


def arena_layout(plan: Plan, tensors: Sequence[int]) -> tuple[dict[int, int], int]:
    """Where each of `tensors` (chunked, in plan order) sits in the arena, and the arena's size.

    A chunked tensor is live from its first bucket to its last; two can share a bucket (one ends
    where the next begins), so each goes at the lowest offset free of the ones still live."""
    spans = bucket_spans(plan)
    offsets: dict[int, int] = {}
    live: list[tuple[int, int, int]] = []  # (offset, end, last bucket)
    size = 0
    for tensor in tensors:
        first, last = spans.get(tensor, (0, 0))
        live = sorted(entry for entry in live if entry[2] >= first)
        nbytes = _aligned(tensor_nbytes(plan.tensors[tensor]))
        offset = 0
        for start, end, _ in live:
            if offset + nbytes <= start:
                break
            offset = max(offset, end)
        offsets[tensor] = offset
        live.append((offset, offset + nbytes, last))
        size = max(size, offset + nbytes)
    return offsets, size


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Landing:
    """One sync's landing site on the receiver, from the accepted plan to commit or abort.

    Args:
        plan: the accepted plan.
        sink: where the sync goes.
        version: the version being synced.
        digest: the plan's digest, as offered.
        verify: this sync's verification ("off", "bucket" or "full").
        staging: the receiver's reusable staging space.
        delta: the plan patches the version the destinations hold (`Offer.base`): encoded
            tensors are staged and applied in place (`delta.apply_patch`) when complete.
    """

    def __init__(
        self,
        plan: Plan,
        sink: WeightSink,
        version: int,
        digest: str,
        verify: Verify = "off",
        staging: Staging | None = None,
        *,
        delta: bool = False,
    ) -> None:
        self.plan = plan
        self.delta = delta
        self.sink = sink
        self.version = version
        self.digest = digest
        self.verify: Verify = verify
        self.hashes = SyncHashes(plan)
        """The checksums of the buckets verified so far, and the tensors' digests."""
        self.touched_live = False
        """True once any byte was written into live weights (an abort then leaves a mix)."""
        self.landing_s = 0.0
        """Seconds spent copying pieces into place or staging, and checking checksums."""
        self.load_s = 0.0
        """Seconds spent in the sink's `load`."""
        self._delivered: dict[int, int] = {}
        """verify="full": the hash of each tensor handed to the sink or copied out of staging."""
        self._encoded = {index for index, spec in enumerate(plan.tensors) if spec.encoding != "dense"}
        """Tensors that travel as patches: staged, then applied into their destinations."""
        if self._encoded and not delta:
            raise PlanError("the plan carries patches but names no base version to apply them to")
        self._dest: list[torch.Tensor | None] = [self._destination(index) for index in range(len(plan.tensors))]
        self._staged: dict[int, torch.Tensor] = {}
        self._lent: dict[int, np.ndarray | torch.Tensor] = {}
        """Tensors whose bytes stay in the transport's buffer until their bucket is delivered."""
        self._bounce: torch.Tensor | None = None
        self._staging = staging if staging is not None else Staging()
        num_pieces = Counter(piece.tensor for bucket in plan.buckets for piece in bucket)
        self._whole = {tensor for tensor, count in num_pieces.items() if count == 1}
        """Tensors that travel in one piece: lent to a borrowing sink rather than copied."""
        borrowing = self.sink.traits.borrows
        chunked = [t for t in sorted(num_pieces) if t not in self._whole and self._stageable(t)] if borrowing else []
        # patches too: staged until applied, in the reused arena rather than fresh memory each sync
        staged = sorted({*chunked, *(t for t in self._encoded if t in num_pieces)})
        self._arena_offsets, arena_bytes = arena_layout(plan, staged)
        self.lends_chunked = bool(chunked)
        """Whether the sink borrows tensors larger than a bucket that have no destination."""
        self._completes: list[list[int]] = [
            [p.tensor for p in bucket if p.tensor_offset + p.nbytes == tensor_nbytes(plan.tensors[p.tensor])]
            for bucket in plan.buckets
        ]
        self._check_staging_fits(arena_bytes)
        self._arena_bytes = arena_bytes
        self._arena: torch.Tensor | None = None
        """Taken from `staging` when a piece first lands there (a ring that stages chunked
        tensors itself lends them instead, and the arena is never needed)."""

    def _destination(self, index: int) -> torch.Tensor | None:
        spec = self.plan.tensors[index]
        with sink_errors("destination"):
            dest = self.sink.destination(spec.name)
        if dest is not None and (tuple(dest.shape) != spec.shape or dest.dtype != dtype_from_name(spec.dtype)):
            raise PlanError(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, destination is {dest.dtype}{list(dest.shape)}"
            )
        if spec.encoding != "dense" and (dest is None or not dest.is_contiguous()):
            raise PlanError(
                f"{spec.name!r} arrives as a patch, and the sink has no contiguous destination to apply it to"
            )
        return dest

    def _check_staging_fits(self, arena_bytes: int) -> None:
        """Refuse, before allocating anything, a plan whose staged tensors cannot fit in memory.

        Staged tensors live one bucket at a time, chunked ones in the arena across their
        buckets, so the largest staged tensor and the arena are what must fit; a hostile plan
        claiming a 1 TB tensor stops here.
        """
        staged = [tensor_nbytes(spec) for index, spec in enumerate(self.plan.tensors) if not self.direct(index)]
        needed = max([arena_bytes, *staged])
        available = psutil.virtual_memory().available + self._staging.nbytes
        if needed > available:
            raise PlanError(
                f"plan needs to stage a {needed}-byte tensor; only {available} bytes of memory are available"
            )

    # --- where a tensor lands -----------------------------------------------------------------

    def on_device(self, tensor: int) -> bool:
        """Whether tensor `tensor` lands piece by piece in its destination on a device."""
        dest = self._dest[tensor]
        return self.direct(tensor) and dest is not None and dest.device.type != "cpu"

    def direct(self, tensor: int) -> bool:
        """Whether tensor `tensor` lands in its destination with no staging copy."""
        dest = self._dest[tensor]
        return tensor not in self._encoded and dest is not None and dest.is_contiguous()

    def _stageable(self, tensor: int) -> bool:
        """Whether tensor `tensor` may be assembled in the arena (a whole tensor, not a patch)."""
        return not self.direct(tensor) and tensor not in self._encoded

    @property
    def patchable(self) -> bool:
        """Whether every tensor sits in a contiguous destination, where a later patch can go."""
        return all(dest is not None and dest.is_contiguous() for dest in self._dest)

    def destination_digest(self) -> str | None:
        """The content digest of every destination as it is now (the full version, whatever
        travelled), or None when some tensor has no destination to hash."""
        if not self.patchable:
            return None
        digests = tensor_digests([byte_view(dest.cpu()) for dest in self._dest if dest is not None])
        return content_digest(self.plan.tensors, digests)

    def any_on_device(self) -> bool:
        return any(self.on_device(tensor) for tensor in range(len(self.plan.tensors)))

    # --- the verbs a data plane uses ----------------------------------------------------------

    def host_view(self, piece: Piece) -> np.ndarray:
        """The writable host bytes `piece` lands in: its destination's, its place in the staging
        arena, or its own staging tensor's. A piece bound for a device has none: use
        `device_view`, `copy_in` or `read_in`."""
        if self.on_device(piece.tensor):
            raise PlanError(f"piece of tensor {piece.tensor} lands on a device, not in host memory")
        dest = self._dest[piece.tensor]
        if dest is not None and self.direct(piece.tensor):
            self.touched_live = self.touched_live or self.sink.traits.live_destinations
            whole = byte_view(dest)
        elif (arena := self._in_arena(piece.tensor)) is not None:
            whole = arena.numpy()
        else:
            whole = byte_view(self._stage(piece.tensor))
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def lends(self, piece: Piece) -> bool:
        """Whether `piece` is not copied at all: its bytes are lent, from the transport's buffer,
        to a sink that borrows them for the length of a `load`."""
        return piece.tensor in self._whole and self.lendable(piece.tensor)

    def lendable(self, tensor: int) -> bool:
        """Whether tensor `tensor` may be lent to the sink from wherever a transport holds it whole."""
        return self.sink.traits.borrows and self._stageable(tensor)

    def host_site(self, tensor: int) -> np.ndarray | None:
        """All the host bytes tensor `tensor` lands in, in place, or None when it has no such
        destination (it is staged, or lands on a device). For a data plane that lets the sender
        write there directly (one-sided writes): it calls `mark_live_written` once one may begin."""
        dest = self._dest[tensor]
        if dest is None or not self.direct(tensor) or self.on_device(tensor):
            return None
        return byte_view(dest)

    def mark_live_written(self) -> None:
        """A peer may be writing into the destinations `host_site` gave out, unseen by us."""
        self.touched_live = self.touched_live or self.sink.traits.live_destinations

    def device_view(self, piece: Piece) -> torch.Tensor | None:
        """The device bytes (a uint8 tensor) `piece` lands in, or None when it lands in host memory."""
        dest = self._dest[piece.tensor]
        if dest is None or not self.on_device(piece.tensor):
            return None
        self.touched_live = self.touched_live or self.sink.traits.live_destinations
        whole = dest.detach().reshape(-1).view(torch.uint8)
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def copy_in(
        self,
        piece: Piece,
        data: np.ndarray | torch.Tensor,
        *,
        pinned: bool = False,
        whole: np.ndarray | None = None,
    ) -> None:
        """Copy `data`, the piece's bytes in a transport's buffer (host bytes, or a uint8 tensor
        on a device), to where the piece goes. `pinned`: host `data` is page-locked for CUDA
        (hostpin), so a device copies it by DMA directly. `whole`: the transport holds the
        piece's entire tensor there, contiguous (`data` is part of it), until the tensor's last
        bucket is finished: a borrowing sink is lent that, nothing copied. Device copies are
        left in flight on the current stream: synchronise before reusing `data`."""
        started = time.perf_counter()
        self._copy_in(piece, data, pinned, whole)
        self.landing_s += time.perf_counter() - started

    def _copy_in(self, piece: Piece, data: np.ndarray | torch.Tensor, pinned: bool, whole: np.ndarray | None) -> None:
        device = self.device_view(piece)
        if device is None and (self.lends(piece) or (whole is not None and self.lendable(piece.tensor))):
            self._lent[piece.tensor] = data if whole is None else whole
        elif device is None:
            out = self.host_view(piece)
            if isinstance(data, np.ndarray):
                copy_bytes(out, data)
            else:
                torch.from_numpy(out).copy_(data)
        elif isinstance(data, torch.Tensor):
            device.copy_(data)
        elif pinned:
            device.copy_(readable_tensor(data))
        else:
            self.read_in(piece, lambda out: copy_bytes(out, data))

    def read_in(self, piece: Piece, read: Callable[[np.ndarray], object]) -> None:
        """Have `read` write the piece's bytes into host memory (a socket's `recv_into`): its
        host landing site or, for a device destination, a bounce buffer of one bucket (pinned
        for CUDA, so the copy to the device is a DMA) then copied over."""
        device = self.device_view(piece)
        if device is None and self.lends(piece):
            received = self._staging.receive_buffer(self.plan.bucket_bytes)
            data = received[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
            read(data)
            self._lent[piece.tensor] = data
            return
        if device is None:
            read(self.host_view(piece))
            return
        if self._bounce is None:
            self._bounce = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, pin_memory=device.is_cuda)
        bounce = self._bounce[: piece.nbytes]
        read(bounce.numpy())
        device.copy_(bounce)  # synchronous from pageable or pinned: the bounce buffer is free again

    def adopt(self, tensor: int, value: torch.Tensor) -> bool:
        """Take `value` (already in the wire dtype and shape) as tensor `tensor`'s content without
        copying, when it has no direct destination. Returns False when the caller must copy."""
        if self.direct(tensor):
            return False
        self._staged[tensor] = value
        return True

    def finish_bucket(self, index: int, checksum: int | None = None) -> None:
        """Check bucket `index` (when the sync verifies and the transport sent a checksum), then
        deliver the tensors it completed to their destinations or the sink."""
        if self.verify != "off" and checksum is not None:
            started = time.perf_counter()
            pieces = self.plan.buckets[index]
            landed = self.hashes.bucket(pieces, [self._landed(piece) for piece in pieces])
            self.landing_s += time.perf_counter() - started
            if landed != checksum:
                raise ChecksumError(
                    f"bucket {index} of version {self.version}: the bytes that landed hash to {landed:#018x}, "
                    f"the sender's to {checksum:#018x}",
                    version=self.version,
                    bucket=index,
                )
        self._deliver(self._completes[index])

    def _deliver(self, tensors: Sequence[int]) -> None:
        loads = []
        for tensor in tensors:
            if self.direct(tensor):
                continue
            if tensor in self._encoded:
                self._patch(tensor)
                continue
            value = self._value(tensor)
            if self.verify == "full":
                self._delivered[tensor] = xxhash.xxh3_64_intdigest(byte_view(value.contiguous()).data)
            dest = self._dest[tensor]
            if dest is not None:
                self.touched_live = self.touched_live or self.sink.traits.live_destinations
                dest.copy_(value)
            else:
                loads.append((self.plan.tensors[tensor].name, value))
        if loads:
            self.touched_live = self.touched_live or self.sink.traits.live_loads
            started = time.perf_counter()
            with sink_errors("load"):
                self.sink.load(loads)
            self.load_s += time.perf_counter() - started

    def _patch(self, tensor: int) -> None:
        spec, dest = self.plan.tensors[tensor], self._dest[tensor]
        if spec.count == 0 or dest is None:
            return  # unchanged (destinations of patches were checked at the start)
        payload = self._staged.pop(tensor, None)  # adopted whole (inproc), else in the arena
        if payload is None:
            payload = self._in_arena(tensor)
        if payload is None:
            raise PlanError(f"patch of {spec.name!r} completed with no bytes landed")
        self.touched_live = self.touched_live or self.sink.traits.live_destinations
        apply_patch(dest, spec, payload)

    def check_tensors(self, expected: Sequence[int]) -> None:
        """verify="full": every tensor, where it finally sits, hashes as the sender's did."""
        if len(expected) != len(self.plan.tensors):
            raise ChecksumError(
                f"version {self.version}: {len(expected)} tensor digests for {len(self.plan.tensors)} tensors"
            )
        for index, spec in enumerate(self.plan.tensors):
            dest = self._dest[index]
            if dest is not None and self.direct(index):
                landed = xxhash.xxh3_64_intdigest(byte_view(dest.cpu()).data)
            else:
                landed = self._delivered.get(index, -1)
            if landed != expected[index]:
                raise ChecksumError(
                    f"version {self.version}: tensor {spec.name!r} does not hold the bytes the sender sent",
                    version=self.version,
                )

    def _landed(self, piece: Piece) -> np.ndarray:
        """The piece's bytes where they landed, in host memory (a copy for a device destination)."""
        lent = self._lent.get(piece.tensor)
        if lent is not None:  # the piece's bytes, or its whole tensor's
            lent = lent[piece.tensor_offset : piece.tensor_offset + piece.nbytes]
            return lent if isinstance(lent, np.ndarray) else lent.cpu().numpy()
        device = self.device_view(piece)
        return self.host_view(piece) if device is None else device.cpu().numpy()

    def _value(self, tensor: int) -> torch.Tensor:
        """Complete tensor `tensor` where it landed off its destination, as the sink gets it."""
        spec = self.plan.tensors[tensor]
        lent = self._lent.pop(tensor, None)
        if lent is not None:
            return _typed(lent, spec.dtype, spec.shape)
        if tensor in self._staged:
            return self._staged.pop(tensor)
        arena = self._in_arena(tensor)
        if arena is not None:
            return _typed(arena, spec.dtype, spec.shape)
        return self._stage(tensor)

    @property
    def arena_unused(self) -> bool:
        """The plan had tensors to assemble in the arena and none was: the transport lent them
        whole from a buffer of its own (the shm ring's staging area)."""
        return self._arena_bytes > 0 and self._arena is None

    def _in_arena(self, tensor: int) -> torch.Tensor | None:
        """Tensor `tensor`'s bytes in the staging arena, or None when it is not assembled there."""
        start = self._arena_offsets.get(tensor)
        if start is None:
            return None
        if self._arena is None:
            self._arena = self._staging.arena(self._arena_bytes)
        return self._arena[start : start + tensor_nbytes(self.plan.tensors[tensor])]

    def _stage(self, tensor: int) -> torch.Tensor:
        staged = self._staged.get(tensor)
        if staged is None:
            spec = self.plan.tensors[tensor]
            staged = host_bytes(tensor_nbytes(spec))
            if tensor not in self._encoded:  # a patch stays raw bytes
                staged = _typed(staged, spec.dtype, spec.shape)
            self._staged[tensor] = staged
        return staged


def _typed(data: np.ndarray | torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes as a tensor of `dtype` and `shape`, no copy (a read-only buffer stays read-only:
    torch warns that it cannot enforce that, and the `load` contract already says so)."""
    if isinstance(data, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(data)
    return data.view(dtype_from_name(dtype)).reshape(shape)
