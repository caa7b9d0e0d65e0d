"""Landing: where each planned byte of one sync goes on the receiving side.

The mirror of `pack.py`. `Landing` decides each tensor's route once, when the sync begins
(`Landing.routes`, one `Route` per tensor); a data plane then hands over each piece's bytes
(`copy_in` from a buffer, `read_in` from a reader such as a socket) or writes them at the piece's
`target`, and calls `finish_bucket`, which checks the bucket (when the sync verifies) and delivers
the tensors it completed. The routes:

- "host", "device": a contiguous destination of the right shape and dtype, written in place,
  piece by piece (on a GPU too, straight from the transport's buffer);
- "lent": no such destination, a sink that `borrows` (an engine's loader), and the tensor whole
  in one bucket: not copied at all. `load` gets a read-only view of the transport's buffer (a
  ring slot, a GPU slot, a reused receive buffer), valid for the call;
- "arena": the same, chunked over several buckets: lent too when the transport holds the whole
  tensor in a buffer of its own (the shm ring's staging area), else assembled in the receiver's
  staging arena (`Staging`), allocated once, pre-faulted and reused across syncs;
- "own": anything else without a destination to write in place (a sink that keeps what it is
  handed): a host tensor of its own;
- "patch": a delta's encoded tensor, staged in the arena and applied in place when complete.

A sharded sync's plan comes in parts, one per sender, each landed on its own connection's
thread into the one `Landing`: its verbs take a lock, a tensor is delivered once its last piece
landed, whichever part brought it, and a tensor without a destination gets one of its own
("own": parts land in any order, so nothing is lent from a transport's buffer or shares arena
space). A box of a tensor (`TensorSpec.region`) lands in that box of the sink's destination
when it has one of the whole tensor's shape.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import psutil
import torch

from weightsync.checksum import SyncHashes, Verify, content_digest, tensor_hash, tensor_hashes
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ChecksumError, PlanError, SinkError
from weightsync.hostmem import host_bytes
from weightsync.hostpin import readable_tensor
from weightsync.messages import Piece, Plan
from weightsync.pack import byte_view, copy_bytes, flat_bytes
from weightsync.patch import apply_patch
from weightsync.plan import arena_layout, tensor_nbytes
from weightsync.regions import region_view
from weightsync.sink import WeightSink, sink_errors

__all__ = ["Landing", "Route", "Staging"]

Route = Literal["host", "device", "lent", "arena", "own", "patch"]
"""Where a tensor lands (the module's docstring says what each means)."""
IN_PLACE: tuple[Route, ...] = ("host", "device")


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
        return self._arena.numel() + self._receive.numel()


def _prefaulted(nbytes: int) -> torch.Tensor:
    buffer = host_bytes(nbytes)
    buffer.fill_(0)  # touch every page now, not during a sync
    return buffer


class Landing:
    """One sync's landing site on the receiver, from the accepted plan to commit or abort.

    Every tensor's route is decided once, here (`routes`); every later step reads it.

    Args:
        plan_id: the plan's id, as offered.
        staging: the receiver's reusable staging space.
        delta: the plan patches the version the destinations hold (`Offer.delta_base`): encoded
            tensors are staged and applied in place (`delta.apply_patch`) when complete.
    """

    def __init__(
        self,
        plan: Plan,
        sink: WeightSink,
        version: int,
        plan_id: str,
        verify: Verify = "off",
        staging: Staging | None = None,
        *,
        delta: bool = False,
    ) -> None:
        self.plan = plan
        self.delta = delta
        self.sink = sink
        self.version = version
        self.plan_id = plan_id
        self.verify: Verify = verify
        self.hashes = SyncHashes(plan)
        """The checksums of the buckets verified so far, and the tensors' digests."""
        self.touched_live = False
        """True once any byte was written into live weights (an abort then leaves a mix)."""
        self.landing_s = 0.0
        """Seconds spent copying pieces into place or staging, and checking checksums."""
        self.load_s = 0.0
        """Seconds spent in the sink's `load`."""
        if not delta and any(spec.encoding != "dense" for spec in plan.tensors):
            raise PlanError("the plan carries patches but names no base version to apply them to")
        self._dest = [self._destination(index) for index in range(len(plan.tensors))]
        num_pieces = Counter(piece.tensor for bucket in plan.buckets for piece in bucket)
        self.routes: tuple[Route, ...] = tuple(self._route(t, num_pieces[t]) for t in range(len(plan.tensors)))
        """Each tensor's route (`Route`), fixed for the sync."""
        self._remaining = num_pieces
        """Each tensor's pieces not landed yet: it is delivered when none is left."""
        self._lock = threading.RLock()
        """Held by every verb: the parts of a sharded sync land on several threads."""
        self.failed: BaseException | None = None
        """Why the sync failed (a part's error): every verb raises it from then on."""
        self._arena_offsets, self._arena_bytes = arena_layout(
            plan, [t for t in sorted(num_pieces) if self.routes[t] in ("arena", "patch")], in_order=not plan.parts
        )
        self._staging = staging if staging is not None else Staging()
        self._check_staging_fits()
        self._arena: torch.Tensor | None = None
        """Taken from `staging` when a piece first lands there (a ring that holds chunked
        tensors whole lends them instead, and the arena is never needed)."""
        self._staged: dict[int, torch.Tensor] = {}
        """Tensors of their own ("own"), or adopted whole (`adopt`)."""
        self._lent: dict[int, np.ndarray | torch.Tensor] = {}
        """Tensors whose bytes stay in the transport's buffer until their bucket is delivered."""
        self._delivered: dict[int, int] = {}
        """verify="full": the hash of each tensor handed to the sink or copied out of staging."""
        self._patched: dict[int, int] = {}
        """The hash of each destination its patch's apply took on the way (`apply_patch`)."""
        self._bounce: torch.Tensor | None = None

    def _destination(self, index: int) -> torch.Tensor | None:
        spec = self.plan.tensors[index]
        with sink_errors("destination"):
            dest = self.sink.destination(spec.name)
        if dest is not None and spec.region is not None and tuple(dest.shape) == spec.region.whole:
            dest = region_view(dest, spec)
        if dest is not None and (tuple(dest.shape) != spec.shape or dest.dtype != dtype_from_name(spec.dtype)):
            raise PlanError(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, destination is {dest.dtype}{list(dest.shape)}"
            )
        if spec.encoding != "dense" and (dest is None or not dest.is_contiguous()):
            raise PlanError(
                f"{spec.name!r} arrives as a patch, and the sink has no contiguous destination to apply it to"
            )
        return dest

    def _route(self, tensor: int, num_pieces: int) -> Route:
        dest = self._dest[tensor]
        if self.plan.tensors[tensor].encoding != "dense":
            return "patch"
        if dest is not None and dest.is_contiguous():
            return "host" if dest.device.type == "cpu" else "device"
        if not self.sink.traits.borrows or self.plan.parts:
            return "own"
        return "lent" if num_pieces <= 1 else "arena"

    def _check_staging_fits(self) -> None:
        """Refuse, before allocating anything, a plan whose staged tensors cannot fit in memory.

        Staged tensors live one bucket at a time, chunked ones in the arena across their
        buckets, so the largest staged tensor and the arena are what must fit; a hostile plan
        claiming a 1 TB tensor stops here.
        """
        routes = zip(self.plan.tensors, self.routes, strict=True)
        staged = [tensor_nbytes(spec) for spec, route in routes if route not in IN_PLACE]
        needed = max([self._arena_bytes, *staged])
        available = psutil.virtual_memory().available + self._staging.nbytes
        if needed > available:
            raise PlanError(
                f"plan needs to stage a {needed}-byte tensor; only {available} bytes of memory are available"
            )

    # --- what the receiver loop asks ----------------------------------------------------------

    @property
    def cut(self) -> bool:
        """Whether the plan carries boxes of tensors, or parts from several senders (sharded
        sync): no whole tensor lands here."""
        return bool(self.plan.parts) or any(spec.region is not None for spec in self.plan.tensors)

    @property
    def lends_chunked(self) -> bool:
        """Whether the sink borrows tensors larger than a bucket that have no destination."""
        return "arena" in self.routes

    @property
    def arena_unused(self) -> bool:
        """The plan had tensors to assemble in the arena and none was: the transport lent them
        whole from a buffer of its own (the shm ring's staging area)."""
        return self._arena_bytes > 0 and self._arena is None

    @property
    def patchable(self) -> bool:
        """Whether every tensor sits in a contiguous destination, where a later patch can go."""
        return all(route in (*IN_PLACE, "patch") for route in self.routes)

    def destination_digest(self) -> str | None:
        """The content digest of every destination as it is now (the full version, whatever
        travelled), or None when some tensor has no destination to hash."""
        if not self.patchable:
            return None
        held = [(i, dest) for i, dest in enumerate(self._dest) if dest is not None]
        rest = [(i, dest) for i, dest in held if i not in self._patched]  # not hashed by their apply
        hashed = dict(self._patched)
        hashed.update(
            zip((i for i, _ in rest), tensor_hashes([byte_view(dest.cpu()) for _, dest in rest]), strict=True)
        )
        return content_digest(self.plan.tensors, [hashed[i] for i, _ in held])

    def check_tensors(self, expected: Sequence[int]) -> None:
        """verify="full": every tensor, where it finally sits, hashes as the sender's did."""
        if len(expected) != len(self.plan.tensors):
            raise ChecksumError(
                f"version {self.version}: {len(expected)} tensor digests for {len(self.plan.tensors)} tensors"
            )
        for index, spec in enumerate(self.plan.tensors):
            dest = self._dest[index]
            if dest is not None and self.routes[index] in IN_PLACE:
                landed = tensor_hash(byte_view(dest.cpu()))
            else:
                landed = self._delivered.get(index, -1)
            if landed != expected[index]:
                raise ChecksumError(
                    f"version {self.version}: tensor {spec.name!r} does not hold the bytes the sender sent",
                    version=self.version,
                )

    # --- the verbs a data plane uses ----------------------------------------------------------

    def sites(self) -> list[np.ndarray | None]:
        """Each tensor's in-place host bytes ("host"), or None: for a plane whose peer writes
        there itself (one-sided writes), which asks for their `target` once writes may begin."""
        places = zip(self._dest, self.routes, strict=True)
        return [byte_view(dest) if dest is not None and route == "host" else None for dest, route in places]

    def target(self, piece: Piece) -> np.ndarray | torch.Tensor | None:
        """Where `piece`'s bytes go: host bytes (its destination's, its place in the arena, or
        its own tensor's), a device's bytes (a uint8 tensor), or None for a lent piece: the
        transport's buffer is kept (`copy_in`, `read_in`)."""
        with self._lock:
            self._check_live()
            return None if self.routes[piece.tensor] == "lent" else self._site(piece)

    def _site(self, piece: Piece) -> np.ndarray | torch.Tensor:
        route, dest = self.routes[piece.tensor], self._dest[piece.tensor]
        whole: np.ndarray | torch.Tensor
        if dest is not None and route in IN_PLACE:
            self._touch(self.sink.traits.live_destinations)
            whole = byte_view(dest) if route == "host" else dest.detach().reshape(-1).view(torch.uint8)
        elif route in ("arena", "patch"):
            whole = self._in_arena(piece.tensor).numpy()
        else:
            whole = byte_view(self._stage(piece.tensor))
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def copy_in(
        self,
        piece: Piece,
        data: np.ndarray | torch.Tensor,
        *,
        pinned: bool = False,
        whole: np.ndarray | None = None,
    ) -> None:
        """Land `data`, the piece's bytes in a transport's buffer (host bytes, or a uint8 tensor
        on a device): lent ("lent", or "arena" when the transport holds the piece's entire
        tensor in `whole`, contiguous, until its last bucket is finished), else copied to its
        `target`. `pinned`: host `data` is page-locked for CUDA (hostpin), so a device copies it
        by DMA directly. Device copies are left in flight on the current stream: synchronise
        before reusing `data`."""
        with self._lock:
            self._check_live()
            started = time.perf_counter()
            route = self.routes[piece.tensor]
            if route == "lent" or (whole is not None and route == "arena"):
                self._lent[piece.tensor] = data if whole is None else whole
            elif isinstance(target := self._site(piece), np.ndarray):
                if isinstance(data, np.ndarray):
                    copy_bytes(target, data)
                else:
                    torch.from_numpy(target).copy_(data)
            elif isinstance(data, torch.Tensor) or pinned:
                target.copy_(data if isinstance(data, torch.Tensor) else readable_tensor(data))
            else:
                self.read_in(piece, lambda out: copy_bytes(out, data))
            self.landing_s += time.perf_counter() - started

    def read_in(self, piece: Piece, read: Callable[[np.ndarray], object]) -> None:
        """Have `read` write the piece's bytes into host memory (a socket's `recv_into`): its
        host target; for a lent piece, the reused receive buffer it is lent from; for a device,
        a bounce buffer of one bucket (pinned for CUDA: the copy to the device is a DMA)."""
        with self._lock:
            self._check_live()
            if self.routes[piece.tensor] == "lent":
                received = self._staging.receive_buffer(self.plan.bucket_bytes)
                self._lent[piece.tensor] = data = received[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
                read(data)
            elif isinstance(target := self._site(piece), np.ndarray):
                read(target)
            else:
                if self._bounce is None:
                    self._bounce = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, pin_memory=target.is_cuda)
                bounce = self._bounce[: piece.nbytes]
                read(bounce.numpy())
                target.copy_(bounce)  # synchronous from pageable or pinned: the bounce buffer is free again

    def adopt(self, tensor: int, value: torch.Tensor) -> None:
        """Take `value` (already in the wire dtype and shape) as tensor `tensor`'s content without
        copying (a tensor that does not land in place; in-process only)."""
        with self._lock:
            self._check_live()
            self._staged[tensor] = value

    def copy_tensors(self, values: Sequence[tuple[int, torch.Tensor]]) -> set[torch.device]:
        """Land each (tensor, value) whole from `value`, the sender's own tensor (its dtype and
        layout, read in place on a device: cudaipc's direct path): copied into its destination,
        cast on the way (one copy per byte; those on a GPU together, in as few launches as
        `torch._foreach_copy_` makes); lent in the wire dtype where the sink borrows (a view of
        the sender's memory when no cast is needed); else copied into a tensor of its own.
        Returns the devices whose streams copies are left in flight on: synchronise them
        before the sender may change the values."""
        with self._lock:
            self._check_live()
            started = time.perf_counter()
            dests: list[torch.Tensor] = []
            sources: list[torch.Tensor] = []
            devices: set[torch.device] = set()
            for tensor, value in values:
                dest = self._dest[tensor]
                if dest is not None and self.routes[tensor] in IN_PLACE and _batchable(dest, value):
                    dests.append(dest)
                    sources.append(value)
                else:
                    devices |= self._copy_whole(tensor, value)
            if dests:
                self._touch(self.sink.traits.live_destinations)
                torch._foreach_copy_(dests, sources)
                devices |= {dest.device for dest in dests}
            self.landing_s += time.perf_counter() - started
            return {device for device in devices if device.type == "cuda"}

    def _copy_whole(self, tensor: int, value: torch.Tensor) -> set[torch.device]:
        route, spec, dest = self.routes[tensor], self.plan.tensors[tensor], self._dest[tensor]
        if dest is not None and route in IN_PLACE:
            self._touch(self.sink.traits.live_destinations)
            dest.copy_(value)
            return {dest.device, value.device}
        if route in ("lent", "arena"):
            wire = value.to(dtype_from_name(spec.dtype)).contiguous()
            self._lent[tensor] = flat_bytes(wire)
            return {wire.device}
        if route == "own":
            self._stage(tensor).copy_(value)
            return set()
        raise PlanError(f"{spec.name!r} is a patch; it cannot be read whole from the sender")

    def finish_bucket(self, index: int, checksum: int | None = None) -> None:
        """Check bucket `index` (when the sync verifies and the transport sent a checksum), then
        deliver the tensors it completed to their destinations or the sink."""
        with self._lock:
            self._check_live()
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
            completed = []
            for piece in self.plan.buckets[index]:
                self._remaining[piece.tensor] -= 1
                if not self._remaining[piece.tensor]:
                    completed.append(piece.tensor)
            self._deliver(completed)

    def fail(self, error: BaseException) -> None:
        """The sync failed (on any part's thread): every verb raises from now on, so that the
        other parts stop landing."""
        self.failed = self.failed or error

    def _check_live(self) -> None:
        if self.failed is not None:
            raise SinkError(f"the sync of version {self.version} failed: {self.failed}") from self.failed

    # --- delivery -----------------------------------------------------------------------------

    def _touch(self, live: bool) -> None:
        self.touched_live = self.touched_live or live

    def _deliver(self, tensors: Sequence[int]) -> None:
        loads = []
        for tensor in tensors:
            route, dest = self.routes[tensor], self._dest[tensor]
            if route in IN_PLACE:
                continue
            if route == "patch":
                self._patch(tensor)
                continue
            value = self._value(tensor)
            if self.verify == "full":
                self._delivered[tensor] = tensor_hash(byte_view(value.contiguous()))
            if dest is not None:
                self._touch(self.sink.traits.live_destinations)
                dest.copy_(value)
            else:
                loads.append((self.plan.tensors[tensor].name, value))
        if loads:
            self._touch(self.sink.traits.live_loads)
            started = time.perf_counter()
            with sink_errors("load"):
                self.sink.load(loads)
            self.load_s += time.perf_counter() - started

    def _patch(self, tensor: int) -> None:
        spec, dest = self.plan.tensors[tensor], self._dest[tensor]
        if spec.count == 0 or dest is None:
            return  # unchanged (destinations of patches were checked at the start)
        payload = self._staged.pop(tensor, None)  # adopted whole (inproc), else in the arena
        if payload is None and tensor in self._arena_offsets:
            payload = self._in_arena(tensor)
        if payload is None:
            raise PlanError(f"patch of {spec.name!r} completed with no bytes landed")
        self._touch(self.sink.traits.live_destinations)
        crc = apply_patch(dest, spec, payload)
        if crc is not None:
            self._patched[tensor] = crc

    def _landed(self, piece: Piece) -> np.ndarray:
        """The piece's bytes where they landed, in host memory (a copy for a device destination)."""
        lent = self._lent.get(piece.tensor)
        if lent is not None:  # the piece's bytes, or its whole tensor's
            lent = lent[piece.tensor_offset : piece.tensor_offset + piece.nbytes]
            return lent if isinstance(lent, np.ndarray) else lent.cpu().numpy()
        target = self._site(piece)
        return target if isinstance(target, np.ndarray) else target.cpu().numpy()

    def _value(self, tensor: int) -> torch.Tensor:
        """Complete tensor `tensor` where it landed off its destination, as the sink gets it."""
        spec = self.plan.tensors[tensor]
        lent = self._lent.pop(tensor, None)
        if lent is not None:
            return _typed(lent, spec.dtype, spec.shape)
        if tensor in self._staged:
            return self._staged.pop(tensor)
        if self.routes[tensor] == "arena":
            return _typed(self._in_arena(tensor), spec.dtype, spec.shape)
        return self._stage(tensor)

    def _in_arena(self, tensor: int) -> torch.Tensor:
        """Tensor `tensor`'s bytes in the staging arena (route "arena" or "patch")."""
        if self._arena is None:
            self._arena = self._staging.arena(self._arena_bytes)
        start = self._arena_offsets[tensor]
        return self._arena[start : start + tensor_nbytes(self.plan.tensors[tensor])]

    def _stage(self, tensor: int) -> torch.Tensor:
        """Tensor `tensor`'s own host tensor (route "own"), made when its first piece lands."""
        staged = self._staged.get(tensor)
        if staged is None:
            spec = self.plan.tensors[tensor]
            staged = self._staged[tensor] = _typed(host_bytes(tensor_nbytes(spec)), spec.dtype, spec.shape)
        return staged


BATCHED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What `torch._foreach_copy_` copies in one launch here (model weights); anything else (a cast,
a layout, fp8) is copied tensor by tensor."""


def _batchable(dest: torch.Tensor, value: torch.Tensor) -> bool:
    return (
        dest.device == value.device
        and dest.dtype == value.dtype
        and dest.dtype in BATCHED_DTYPES
        and value.is_contiguous()
    )


def _typed(data: np.ndarray | torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes as a tensor of `dtype` and `shape`, no copy (a read-only buffer stays read-only:
    torch warns that it cannot enforce that, and the `load` contract already says so)."""
    if isinstance(data, np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(data)
    return data.view(dtype_from_name(dtype)).reshape(shape)
