"""Where received weights go, and how each planned byte lands there.

A `WeightSink` is the receiving engine's side of a sync. It may expose destination tensors by
name (`destination`), in which case every chunk is copied straight into place; otherwise whole
tensors are handed to `load` as they complete. `Landing` tracks one sync's progress against the
plan on the receiving side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import psutil
import torch
import xxhash

from weightsync.checksum import bucket_checksum
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ChecksumError, ConfigError, PlanError, SinkError, WeightSyncError
from weightsync.hostpin import readable_tensor
from weightsync.pack import byte_view, copy_bytes
from weightsync.plan import tensor_nbytes
from weightsync.types import Piece, Plan

__all__ = ["CallableSink", "Landing", "StagedSink", "TensorDictSink", "WeightSink", "as_sink"]

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightSink:
    """Base class for what receives weights. Override the hooks your engine needs.

    Order of calls for one sync: `begin` (may reject the plan before any byte moves), then
    `destination` per tensor, then `load` per bucket for tensors without a destination, then
    exactly one of `commit` or `abort`.
    """

    loads_live: bool = False
    """True when `load` writes into the weights being served (an engine's loader), so a sync that
    fails after any `load` leaves them mixed; the receiver then reports itself dirty."""

    destinations_live: bool = True
    """False when `destination` hands out a standby copy (staged mode) that only `commit` makes
    live: then a failed sync leaves the served weights untouched."""

    wrote_live: bool = False
    """Set by a staged sink whose `commit` feeds the served weights (StagedSink), once it has
    started to: a commit that fails after that leaves them mixed, and the receiver says dirty."""

    def begin(self, plan: Plan, version: int) -> None:
        """Check the plan against the engine; raise PlanError to refuse it."""

    def destination(self, name: str) -> torch.Tensor | None:
        """The live tensor `name` should be written into, or None to receive it via `load`."""
        return None

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Take complete tensors. They may be views into transfer buffers: copy what you keep."""
        raise SinkError(f"sink {type(self).__name__} has no destination for {[n for n, _ in named_tensors][:5]}")

    def commit(self, version: int) -> None:
        """Every byte of `version` has arrived; start serving it."""

    def abort(self, version: int, error: BaseException) -> None:
        """The sync of `version` failed; `error` says why."""


class CallableSink(WeightSink):
    """A sink that hands every completed tensor to a function."""

    def __init__(self, load: LoadFn) -> None:
        self._load = load

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._load(named_tensors)


class TensorDictSink(WeightSink):
    """A sink that writes into existing tensors, in place, by name.

    Args:
        tensors: destination tensors by name (e.g. `dict(model.named_parameters())`).
        strict: also refuse plans that leave some of `tensors` out.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        self.tensors = dict(tensors)
        self.strict = strict
        self.version: int | None = None

    def begin(self, plan: Plan, version: int) -> None:
        check_against(plan, self.tensors, strict=self.strict)

    def destination(self, name: str) -> torch.Tensor | None:
        return self.tensors[name].data

    def commit(self, version: int) -> None:
        self.version = version


class StagedSink(WeightSink):
    """Land every sync in a standby copy, and hand it to `inner` only at commit.

    For an engine whose loader cannot swap weights atomically (vLLM's layerwise reload): a sync
    that fails in transfer (a dead sender, a timeout, a bad checksum) never reaches the engine,
    and a rollout server keeps serving during the transfer, pausing only for the local load.
    The standby copy (one more copy of the weights, in host memory) is kept across syncs.

    Args:
        inner: the engine's sink; `begin` must only check the plan (it runs while serving).
        batch_bytes: how much `commit` hands to `inner.load` at a time.
    """

    destinations_live = False
    loads_live = False

    def __init__(self, inner: WeightSink, batch_bytes: int = 64 << 20) -> None:
        self.inner = inner
        self.batch_bytes = batch_bytes
        self._standby: dict[str, torch.Tensor] = {}
        self._plan: Plan | None = None

    def begin(self, plan: Plan, version: int) -> None:
        self.wrote_live = False
        self.inner.begin(plan, version)
        for spec in plan.tensors:
            shape, dtype = spec.shape, dtype_from_name(spec.dtype)
            standby = self._standby.get(spec.name)
            if standby is None or tuple(standby.shape) != shape or standby.dtype != dtype:
                self._standby[spec.name] = torch.empty(shape, dtype=dtype)
        self._plan = plan

    def destination(self, name: str) -> torch.Tensor | None:
        return self._standby[name]

    def commit(self, version: int) -> None:
        assert self._plan is not None
        self.wrote_live = True
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for spec in self._plan.tensors:
            tensor = self._standby[spec.name]
            dest = self.inner.destination(spec.name)
            if dest is not None:
                dest.copy_(tensor)
                continue
            batch.append((spec.name, tensor))
            size += tensor_nbytes(spec)
            if size >= self.batch_bytes:
                self.inner.load(batch)
                batch, size = [], 0
        if batch:
            self.inner.load(batch)
        self.inner.commit(version)

    def abort(self, version: int, error: BaseException) -> None:
        self.inner.abort(version, error)


def check_against(plan: Plan, tensors: Mapping[str, torch.Tensor], *, strict: bool) -> None:
    """Raise PlanError naming every tensor of `plan` that `tensors` lacks or disagrees with."""
    problems = []
    for spec in plan.tensors:
        target = tensors.get(spec.name)
        if target is None:
            problems.append(f"unknown tensor {spec.name!r}")
        elif tuple(target.shape) != spec.shape or target.dtype != dtype_from_name(spec.dtype):
            problems.append(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, expected {str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
            )
    if strict:
        missing = set(tensors) - {spec.name for spec in plan.tensors}
        problems += [f"plan lacks {name!r}" for name in sorted(missing)]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise PlanError("plan does not match the receiver's tensors: " + "; ".join(problems[:8]) + more)


def as_sink(sink: WeightSink | LoadFn | Mapping[str, torch.Tensor]) -> WeightSink:
    """Accept a WeightSink; wrap a mapping of destination tensors or a load function."""
    if isinstance(sink, WeightSink):
        return sink
    if isinstance(sink, Mapping):
        return TensorDictSink(sink)
    if callable(sink):
        return CallableSink(sink)
    raise ConfigError(f"a sink must be a WeightSink, a mapping of tensors or a callable, got {type(sink).__name__}")


class Landing:
    """One sync's landing site on the receiver: where each piece's bytes go.

    A tensor with a contiguous destination of the right shape and dtype is written in place, piece
    by piece, also on a GPU (host to device, straight from the transport's buffer). Any other
    tensor is staged in a fresh host tensor and, once complete, copied into its destination or
    handed to `sink.load` at the end of the bucket that completes it.
    """

    def __init__(self, plan: Plan, sink: WeightSink, version: int, digest: str, verify: str = "off") -> None:
        self.plan = plan
        self.sink = sink
        self.version = version
        self.digest = digest
        self.verify = verify
        self.checksums: list[int] = []
        """The checksums of the buckets verified so far, in order."""
        self._delivered: dict[int, int] = {}
        """verify="full": the hash of each tensor handed to the sink or copied out of staging."""
        self.touched_live = False
        """True once any byte was written into a live destination (an abort then leaves a mix)."""
        self._dest: list[torch.Tensor | None] = []
        self._staged: dict[int, torch.Tensor] = {}
        self._bounce: torch.Tensor | None = None
        self._completes: list[list[int]] = [[] for _ in plan.buckets]
        for spec in plan.tensors:
            with sink_errors("destination"):
                dest = sink.destination(spec.name)
            if dest is not None and (tuple(dest.shape) != spec.shape or dest.dtype != dtype_from_name(spec.dtype)):
                raise PlanError(
                    f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, destination is {dest.dtype}{list(dest.shape)}"
                )
            self._dest.append(dest)
        for bucket_index, bucket in enumerate(plan.buckets):
            for piece in bucket:
                if piece.tensor_offset + piece.nbytes == tensor_nbytes(plan.tensors[piece.tensor]):
                    self._completes[bucket_index].append(piece.tensor)
        self._check_staging_fits()

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

    def in_place(self, tensor: int) -> bool:
        """Whether tensor `tensor` is written straight into its destination in host memory."""
        dest = self._dest[tensor]
        return dest is not None and dest.device.type == "cpu" and dest.is_contiguous()

    def on_device(self, tensor: int) -> bool:
        """Whether tensor `tensor` is copied piece by piece into its destination on a device."""
        dest = self._dest[tensor]
        return dest is not None and dest.device.type != "cpu" and dest.is_contiguous()

    def direct(self, tensor: int) -> bool:
        """Whether tensor `tensor` lands in its destination with no staging copy."""
        return self.in_place(tensor) or self.on_device(tensor)

    def target(self, piece: Piece) -> np.ndarray:
        """The writable host bytes `piece` lands in: its destination's, or its staging tensor's.
        Not for a piece with a device destination: `land` or `fill` those."""
        if self.on_device(piece.tensor):
            raise AssertionError("a piece bound for a device has no host target")
        if self.in_place(piece.tensor):
            self.touched_live = self.touched_live or self.sink.destinations_live
            whole = byte_view(self._dest[piece.tensor])  # type: ignore[arg-type]
        else:
            whole = byte_view(self._stage(piece.tensor))
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def land(self, piece: Piece, data: np.ndarray, *, pinned: bool = False) -> None:
        """Copy `data`, the piece's bytes in host memory (a transport's buffer), to where it goes.
        `pinned`: `data` is page-locked for CUDA (hostpin), so a device copies it by DMA directly."""
        if self.on_device(piece.tensor):
            if pinned:
                self.device_target(piece).copy_(readable_tensor(data))
            else:
                self.fill(piece, lambda out: copy_bytes(out, data))
        else:
            copy_bytes(self.target(piece), data)

    def land_tensor(self, piece: Piece, data: torch.Tensor) -> None:
        """Copy `data`, the piece's bytes as a uint8 tensor on a device (a GPU ring slot), to
        where it goes: device to device, or device to host. The caller synchronizes the device."""
        if self.on_device(piece.tensor):
            self.device_target(piece).copy_(data)
        else:
            torch.from_numpy(self.target(piece)).copy_(data)

    def fill(self, piece: Piece, read: Callable[[np.ndarray], object]) -> None:
        """Have `read` write the piece's bytes into host memory (a socket's `recv_into`): its
        destination or staging tensor, or, for a device destination, a bounce buffer of one
        bucket (pinned for CUDA, so the copy to the device is a DMA) then copied over."""
        if not self.on_device(piece.tensor):
            read(self.target(piece))
            return
        if self._bounce is None:
            pinned = self._dest[piece.tensor].device.type == "cuda"  # type: ignore[union-attr]
            self._bounce = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, pin_memory=pinned)
        bounce = self._bounce[: piece.nbytes]
        read(bounce.numpy())
        self.device_target(piece).copy_(bounce)  # synchronous: the bounce buffer is free again

    def landed(self, piece: Piece) -> np.ndarray:
        """The piece's bytes where they landed, in host memory (a copy for a device destination)."""
        if self.on_device(piece.tensor):
            return self.device_target(piece).cpu().numpy()
        return self.target(piece)

    def device_target(self, piece: Piece) -> torch.Tensor:
        """The device bytes (a uint8 tensor) of a piece whose destination is on a device."""
        self.touched_live = self.touched_live or self.sink.destinations_live
        whole = self._dest[piece.tensor].detach().reshape(-1).view(torch.uint8)  # type: ignore[union-attr]
        return whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]

    def adopt(self, tensor: int, value: torch.Tensor) -> bool:
        """Take `value` (already in the wire dtype and shape) as tensor `tensor`'s content without
        copying, when it is not written in place. Returns False when the caller must copy."""
        if self.direct(tensor):
            return False
        self._staged[tensor] = value
        return True

    def finish_bucket(self, index: int, checksum: int | None = None) -> None:
        """Check bucket `index` (when the sync verifies buckets and the transport sent a
        checksum), then deliver the tensors it completed to their destinations or the sink."""
        if self.verify != "off" and checksum is not None:
            landed = bucket_checksum(self.landed(piece) for piece in self.plan.buckets[index])
            if landed != checksum:
                raise ChecksumError(
                    f"bucket {index} of version {self.version}: the bytes that landed hash to {landed:#018x}, "
                    f"the sender's to {checksum:#018x}",
                    version=self.version,
                    bucket=index,
                )
            self.checksums.append(landed)
        loads = []
        for tensor in self._completes[index]:
            if self.direct(tensor):
                continue
            value = self._staged.pop(tensor) if tensor in self._staged else self._stage(tensor)
            if self.verify == "full":
                self._delivered[tensor] = xxhash.xxh3_64_intdigest(byte_view(value.contiguous()))
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

    def check_tensors(self, expected: tuple[int, ...]) -> None:
        """verify="full": every tensor, where it finally sits, hashes as the sender's did."""
        if len(expected) != len(self.plan.tensors):
            raise ChecksumError(
                f"version {self.version}: {len(expected)} tensor digests for {len(self.plan.tensors)} tensors"
            )
        for index, spec in enumerate(self.plan.tensors):
            if self.direct(index):
                landed = xxhash.xxh3_64_intdigest(byte_view(self._dest[index].cpu()))  # type: ignore[union-attr]
            else:
                landed = self._delivered.get(index, -1)
            if landed != expected[index]:
                raise ChecksumError(
                    f"version {self.version}: tensor {spec.name!r} does not hold the bytes the sender sent",
                    version=self.version,
                )

    def _stage(self, tensor: int) -> torch.Tensor:
        staged = self._staged.get(tensor)
        if staged is None:
            spec = self.plan.tensors[tensor]
            staged = torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype))
            self._staged[tensor] = staged
        return staged


@contextmanager
def sink_errors(hook: str) -> Iterator[None]:
    """Report an exception from a sink hook as a SinkError naming the hook (weightsync's own
    errors pass through), so a buggy sink fails the sync cleanly instead of the thread."""
    try:
        yield
    except WeightSyncError:
        raise
    except Exception as exc:
        raise SinkError(f"sink.{hook} raised {type(exc).__name__}: {exc}") from exc
