"""Packing: a bucket's pieces cut out of the source tensors, and the copy routines under it.

The one home of "pack a bucket": `bucket_items` walks the source in plan order and says which
source tensor each piece of each bucket is cut from; `pack_bucket` writes those pieces into a
bucket buffer (host memory, or a GPU ring slot); `piece_bytes` gives a piece's bytes with no
copy where they need no conversion (tcp streams them as they are). Every data plane and
`source_digest` use these.

Same-dtype copies between CPU memory go through `copy_bytes`: our C routine with non-temporal
stores when it was built (about 1.4x `numpy.copyto` for bucket-sized copies, which glibc's memcpy
does with ordinary stores below ~100 MiB), else `numpy.copyto`, itself about twice the speed of a
single-threaded `torch.Tensor.copy_` (docs/benchmarks.md). Casts and non-CPU tensors go through
torch, which converts while copying.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.messages import Piece, Plan, TensorSpec
from weightsync.plan import part_buckets
from weightsync.regions import held_runs
from weightsync.source import Held, SourceLayout, TensorMeta

try:
    from weightsync._native import streamcopy as _streamcopy

    _stream_copy: Callable[[np.ndarray, np.ndarray], None] | None = _streamcopy.copy
    STREAMING_COPY = bool(_streamcopy.STREAMING)  # large copies stream (this CPU has AVX2)
except ImportError:  # built without a C compiler: numpy's memcpy is the fallback
    _stream_copy, STREAMING_COPY = None, False

__all__ = [
    "STREAMING_COPY",
    "BucketItem",
    "bucket_items",
    "byte_view",
    "copy_bytes",
    "flat_bytes",
    "pack_bucket",
    "part_items",
    "piece_bytes",
    "write_piece",
]


def copy_bytes(out: np.ndarray, source: np.ndarray) -> None:
    """Copy `source` into `out`: two contiguous uint8 arrays of the same length."""
    if _stream_copy is None:
        np.copyto(out, source)
    else:
        _stream_copy(out, source)


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    return flat_bytes(tensor).numpy()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory, on its device (no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= 1:
        # torch calls an empty or one-element tensor contiguous whatever its stride (x[::2][:1]),
        # but view(uint8) refuses a stride other than 1; restate it, same memory.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def piece_bytes(tensor: torch.Tensor, wire_dtype: torch.dtype, offset: int, nbytes: int) -> np.ndarray | None:
    """The piece's bytes as a view of the source tensor, or None when they must be converted
    (cast, non-contiguous or non-CPU source) with `write_piece`."""
    if tensor.device.type != "cpu" or tensor.dtype != wire_dtype or not tensor.is_contiguous():
        return None
    return byte_view(tensor)[offset : offset + nbytes]


def write_piece(
    tensor: torch.Tensor, wire_dtype: torch.dtype, offset: int, nbytes: int, out: np.ndarray | torch.Tensor
) -> None:
    """Write bytes [offset, offset + nbytes) of `tensor` as sent in `wire_dtype` into `out`.

    Args:
        tensor: the source tensor, any device, dtype, layout.
        wire_dtype: the dtype the plan sends it as.
        offset: byte offset into the tensor as sent (in `wire_dtype` units).
        nbytes: bytes to write; `out` must hold exactly that many.
        out: a writable uint8 array (a bucket slice or a destination's bytes), or a uint8
            tensor on any device.
    """
    view = piece_bytes(tensor, wire_dtype, offset, nbytes)
    if view is not None and isinstance(out, np.ndarray):
        copy_bytes(out, view)
        return
    if nbytes == 0:
        return
    size = wire_dtype.itemsize
    flat = tensor.detach().reshape(-1)  # a copy only when the source is non-contiguous
    source = flat[offset // size : (offset + nbytes) // size]
    (torch.from_numpy(out) if isinstance(out, np.ndarray) else out).view(wire_dtype).copy_(source)


@dataclasses.dataclass(frozen=True, slots=True)
class BucketItem:
    """One piece of a bucket with the source tensor it is cut from."""

    piece: Piece
    tensor: torch.Tensor
    wire_dtype: torch.dtype


def bucket_items(
    plan: Plan, metas: Sequence[TensorMeta], tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[int, list[BucketItem]]]:
    """Each bucket's pieces with the source tensors they are cut from, consuming the source
    lazily and in plan order (a tensor is taken from it when its first piece is due)."""
    current: tuple[int, torch.Tensor] | None = None
    num_pieces = Counter(piece.tensor for bucket in plan.buckets for piece in bucket)
    for index, bucket in enumerate(plan.buckets):
        items = []
        for piece in bucket:
            if current is None or current[0] != piece.tensor:
                tensor = _next_tensor(tensors, metas[piece.tensor])
                if num_pieces[piece.tensor] > 1 and not tensor.is_contiguous():
                    tensor = tensor.contiguous()  # once per tensor, not once per chunk
                current = (piece.tensor, tensor)
            items.append(BucketItem(piece, current[1], _wire_dtype(plan.tensors[piece.tensor])))
        yield index, items


def part_items(
    plan: Plan, layout: SourceLayout, held: Iterator[tuple[str, torch.Tensor]], boxed: bool = False
) -> Iterator[tuple[int, list[BucketItem]]]:
    """The buckets of this rank's part of `plan` (`layout.rank`), each piece with what it is cut
    from: the intersection of its box with the box this rank holds, a view of `held`'s tensor
    (`boxed`: the box itself, as read) made contiguous, whose bytes are the rank's runs of the
    tensor in order (`held_runs`), and its offset made relative to it. `held` yields every tensor
    of the plan in plan order, and is consumed lazily."""
    current: tuple[int, torch.Tensor] | None = None
    sent = 0
    walked = enumerate(held)
    for index in part_buckets(plan, layout.rank):
        items = []
        for piece in plan.buckets[index]:
            if current is None or current[0] != piece.tensor:
                current, sent = (piece.tensor, _held_cut(plan, layout, piece.tensor, walked, boxed)), 0
            items.append(
                BucketItem(
                    Piece(piece.tensor, sent, piece.bucket_offset, piece.nbytes),
                    current[1],
                    _wire_dtype(plan.tensors[piece.tensor]),
                )
            )
            sent += piece.nbytes
        yield index, items


def _held_cut(
    plan: Plan,
    layout: SourceLayout,
    tensor: int,
    walked: Iterator[tuple[int, tuple[str, torch.Tensor]]],
    boxed: bool,
) -> torch.Tensor:
    """Tensor `tensor`'s part this rank holds, as a contiguous view (or copy) of what `held`
    yields for it."""
    spec = plan.tensors[tensor]
    for index, (name, local) in walked:
        if index < tensor:
            continue
        if index > tensor or name != spec.name:
            break
        box = layout.held[tensor][layout.rank]
        cut = local.detach() if boxed else _cut(spec, local, box or ())
        if cut.numel() * _wire_dtype(spec).itemsize != sum(n for _, n in held_runs(spec, box)):
            raise PlanError(f"{name!r}: this rank holds {list(local.shape)}, which does not fit its layout")
        return cut if cut.is_contiguous() else cut.contiguous()
    raise PlanError(f"the source's held tensors do not follow the plan at {spec.name!r}")


def _cut(spec: TensorSpec, local: torch.Tensor, box: Held) -> torch.Tensor:
    """The intersection of `spec`'s box (the whole tensor for a spec without one) with `box`, a
    view of `local`, which holds `box` of the tensor."""
    view = local.detach()
    start = spec.region.start if spec.region is not None else (0,) * len(spec.shape)
    for dim in range(min(view.dim(), len(spec.shape))):
        first = box[dim][0] if dim < len(box) else 0
        low = min(max(start[dim] - first, 0), view.shape[dim])
        high = min(max(start[dim] + spec.shape[dim] - first, low), view.shape[dim])
        if (low, high) != (0, view.shape[dim]):
            view = view.narrow(dim, low, high - low)
    return view


def _wire_dtype(spec: TensorSpec) -> torch.dtype:
    """What a tensor's bytes are cut from: its wire dtype, or raw bytes for a patch (delta.py)."""
    return dtype_from_name(spec.dtype) if spec.encoding == "dense" else torch.uint8


def _next_tensor(tensors: Iterator[tuple[str, torch.Tensor]], meta: TensorMeta) -> torch.Tensor:
    try:
        name, tensor = next(tensors)
    except StopIteration:
        raise PlanError(f"source ended before yielding {meta.name!r}") from None
    if name != meta.name or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
        raise PlanError(
            f"source yielded {name!r} {tensor.dtype}{list(tensor.shape)} where its metadata promised "
            f"{meta.name!r} {meta.dtype}{list(meta.shape)}"
        )
    return tensor


def pack_bucket(items: Sequence[BucketItem], out: np.ndarray | torch.Tensor) -> list[np.ndarray | torch.Tensor]:
    """Write every piece of `items` at its bucket offset in `out` (a uint8 bucket buffer in host
    memory, or a uint8 tensor on a device); returns each piece's bytes there, in order."""
    views = [out[item.piece.bucket_offset : item.piece.bucket_offset + item.piece.nbytes] for item in items]
    for item, view in zip(items, views, strict=True):
        write_piece(item.tensor, item.wire_dtype, item.piece.tensor_offset, item.piece.nbytes, view)
    return views
