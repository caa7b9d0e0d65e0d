"""Landing: where each planned byte of one sync goes on the receiving side.

The mirror of `pack.py`. A data plane asks for a piece's landing site (`host_view` for host
memory, `device_view` for a device) or hands over the piece's bytes (`copy_in`, `read_in`), then
calls `finish_bucket`, which checks the bucket (when the sync verifies) and delivers the tensors
it completed: a tensor with a contiguous destination of the right shape and dtype was written in
place, piece by piece (on a GPU too, straight from the transport's buffer); any other tensor is
staged in a host tensor and, once complete, copied into its destination or handed to `sink.load`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import psutil
import torch
import xxhash

from weightsync.checksum import SyncHashes, Verify
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ChecksumError, PlanError
from weightsync.hostpin import readable_tensor
from weightsync.pack import byte_view, copy_bytes
from weightsync.plan import tensor_nbytes
from weightsync.sink import WeightSink, sink_errors
from weightsync.types import Piece, Plan

__all__ = ["Landing"]


class Landing:
    """One sync's landing site on the receiver, from the accepted plan to commit or abort.

    Args:
        plan: the accepted plan.
        sink: where the sync goes.
        version: the version being synced.
        digest: the plan's digest, as offered.
        verify: this sync's verification ("off", "bucket" or "full").
    """

    def __init__(self, plan: Plan, sink: WeightSink, version: int, digest: str, verify: Verify = "off") -> None:
        self.plan = plan
        self.sink = sink
        self.version = version
        self.digest = digest
        self.verify: Verify = verify
        self.hashes = SyncHashes(plan)
        """The checksums of the buckets verified so far, and the tensors' digests."""
        self.touched_live = False
        """True once any byte was written into live weights (an abort then leaves a mix)."""
        self._delivered: dict[int, int] = {}
        """verify="full": the hash of each tensor handed to the sink or copied out of staging."""
        self._dest: list[torch.Tensor | None] = [self._destination(index) for index in range(len(plan.tensors))]
        self._staged: dict[int, torch.Tensor] = {}
        self._bounce: torch.Tensor | None = None
        self._completes: list[list[int]] = [
            [p.tensor for p in bucket if p.tensor_offset + p.nbytes == tensor_nbytes(plan.tensors[p.tensor])]
            for bucket in plan.buckets
        ]
        self._check_staging_fits()

    def _destination(self, index: int) -> torch.Tensor | None:
        spec = self.plan.tensors[index]
        with sink_errors("destination"):
            dest = self.sink.destination(spec.name)
        if dest is not None and (tuple(dest.shape) != spec.shape or dest.dtype != dtype_from_name(spec.dtype)):
            raise PlanError(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, destination is {dest.dtype}{list(dest.shape)}"
            )
        return dest

    def _check_staging_fits(self) -> None:
        """Refuse, before allocating anything, a plan whose staged tensors cannot fit in memory.

        Staged tensors live one bucket at a time, plus a chunked tensor across its buckets, so
        the largest one is what must fit; a hostile plan claiming a 1 TB tensor stops here.
        """
        staged = [tensor_nbytes(spec) for index, spec in enumerate(self.plan.tensors) if not self.direct(index)]
        available = psutil.virtual_memory().available
        if staged and max(staged) > available:
            raise PlanError(
                f"plan needs to stage a {max(staged)}-byte tensor; only {available} bytes of memory are available"
            )

    # --- where a tensor lands -----------------------------------------------------------------

    def on_device(self, tensor: int) -> bool:
        """Whether tensor `tensor` lands piece by piece in its destination on a device."""
        dest = self._dest[tensor]
        return dest is not None and dest.device.type != "cpu" and dest.is_contiguous()

    def direct(self, tensor: int) -> bool:
        """Whether tensor `tensor` lands in its destination with no staging copy."""
        dest = self._dest[tensor]
        return dest is not None and dest.is_contiguous()

    def any_on_device(self) -> bool:
        return any(self.on_device(tensor) for tensor in range(len(self.plan.tensors)))

    # --- the verbs a data plane uses ----------------------------------------------------------

    def host_view(self, piece: Piece) -> np.ndarray:
        """The writable host bytes `piece` lands in: its destination's, or its staging tensor's.
        A piece bound for a device has none: use `device_view`, `copy_in` or `read_in`."""
        if self.on_device(piece.tensor):
            raise PlanError(f"piece of tensor {piece.tensor} lands on a device, not in host memory")
        dest = self._dest[piece.tensor]
        if dest is not None and dest.is_contiguous():
            self.touched_live = self.touched_live or self.sink.destinations_live
            whole = byte_view(dest)
        else:
            whole = byte_view(self._stage(piece.tensor))
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

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
        self.touched_live = self.touched_live or self.sink.destinations_live

    def device_view(self, piece: Piece) -> torch.Tensor | None:
        """The device bytes (a uint8 tensor) `piece` lands in, or None when it lands in host memory."""
        dest = self._dest[piece.tensor]
        if dest is None or not self.on_device(piece.tensor):
            return None
        self.touched_live = self.touched_live or self.sink.destinations_live
        whole = dest.detach().reshape(-1).view(torch.uint8)
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def copy_in(self, piece: Piece, data: np.ndarray | torch.Tensor, *, pinned: bool = False) -> None:
        """Copy `data`, the piece's bytes in a transport's buffer (host bytes, or a uint8 tensor
        on a device), to where the piece goes. `pinned`: host `data` is page-locked for CUDA
        (hostpin), so a device copies it by DMA directly. Device copies are left in flight on
        the current stream: synchronise before reusing `data`."""
        device = self.device_view(piece)
        if device is None:
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
            pieces = self.plan.buckets[index]
            landed = self.hashes.bucket(pieces, [self._landed(piece) for piece in pieces])
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
            value = self._staged.pop(tensor) if tensor in self._staged else self._stage(tensor)
            if self.verify == "full":
                self._delivered[tensor] = xxhash.xxh3_64_intdigest(byte_view(value.contiguous()).data)
            dest = self._dest[tensor]
            if dest is not None:
                self.touched_live = self.touched_live or self.sink.destinations_live
                dest.copy_(value)
            else:
                loads.append((self.plan.tensors[tensor].name, value))
        if loads:
            self.touched_live = self.touched_live or self.sink.loads_live
            with sink_errors("load"):
                self.sink.load(loads)

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
        device = self.device_view(piece)
        return self.host_view(piece) if device is None else device.cpu().numpy()

    def _stage(self, tensor: int) -> torch.Tensor:
        staged = self._staged.get(tensor)
        if staged is None:
            spec = self.plan.tensors[tensor]
            staged = torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype))
            self._staged[tensor] = staged
        return staged
