"""The transfer plan: which bytes of which tensor go to which bucket, at which offset.

The sender builds the plan once from tensor metadata, hashes it, and ships it; receivers check it
(`check_plan`) before anything is allocated or written. Chunk boundaries are never recomputed on
the receiving side.

Packing is greedy and in order: each tensor starts on a 64-byte boundary; a tensor that does not
fit in what is left of the current bucket starts a new one; a tensor larger than a bucket fills the
rest of the current bucket and continues over as many whole buckets as it needs (chunking).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import msgspec
import torch

from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import ConfigError, PlanError
from weightsync.messages import Piece, Plan, TensorSpec
from weightsync.sizing import ALIGN_BYTES, align_up
from weightsync.source import TensorMeta

__all__ = [
    "ENCODINGS",
    "PlanCache",
    "arena_layout",
    "INDEX_BYTES",
    "PATCH_BLOCK",
    "bucket_spans",
    "build_plan",
    "check_plan",
    "dense_nbytes",
    "pack_segments",
    "part_buckets",
    "plan_id",
    "tensor_nbytes",
    "wire_specs",
]

MAX_TENSORS = 1 << 20
MAX_NAME_LENGTH = 4096
MAX_DIMS = 16
MAX_PARTS = 1 << 16
"""More senders than any sharded sync has."""
MAX_ELEMENTS = 1 << 56
"""More elements than any real tensor has; keeps every byte size torch computes within int64."""


ENCODINGS = ("dense", "sparse", "blocks")
"""How a tensor's bytes travel (TensorSpec.encoding; patch.py encodes and applies patches)."""
INDEX_BYTES = 4
"""A sparse patch's indices are int32: a tensor of 2**31 elements or more travels dense."""
PATCH_BLOCK = 256
"""Elements per block of a "blocks" patch: a change's offset in its block is one byte, each
block's count of changes a uint16."""


def dense_nbytes(spec: TensorSpec) -> int:
    """The tensor's own size: every element in the wire dtype."""
    return math.prod(spec.shape) * dtype_from_name(spec.dtype).itemsize


def bucket_spans(plan: Plan) -> dict[int, tuple[int, int]]:
    """Each planned tensor's first and last bucket (the same for a tensor in one piece)."""
    spans: dict[int, tuple[int, int]] = {}
    for index, bucket in enumerate(plan.buckets):
        for piece in bucket:
            spans[piece.tensor] = (spans.get(piece.tensor, (index, index))[0], index)
    return spans


def arena_layout(plan: Plan, tensors: Sequence[int], in_order: bool = True) -> tuple[dict[int, int], int]:
    """Where each of `tensors` (chunked, in plan order) sits in an area that holds each whole
    from its first bucket to its last (a receiver's arena, a ring's staging area), and the area's
    size. Two can share a bucket (one ends where the next begins), so each goes at the lowest
    offset free of the ones still live. Not `in_order` (the parts of a sharded sync land side
    by side, in no one order), each has its own place."""
    offsets: dict[int, int] = {}
    if not in_order:
        size = 0
        for tensor in tensors:
            offsets[tensor], size = size, size + align_up(tensor_nbytes(plan.tensors[tensor]))
        return offsets, size
    spans = bucket_spans(plan)
    live: list[tuple[int, int, int]] = []  # (offset, end, last bucket)
    size = 0
    for tensor in tensors:
        first, last = spans.get(tensor, (0, 0))
        live = sorted(entry for entry in live if entry[2] >= first)
        nbytes = align_up(tensor_nbytes(plan.tensors[tensor]))
        offset = 0
        for start, end, _ in live:
            if offset + nbytes <= start:
                break
            offset = max(offset, end)
        offsets[tensor] = offset
        live.append((offset, offset + nbytes, last))
        size = max(size, offset + nbytes)
    return offsets, size


def tensor_nbytes(spec: TensorSpec) -> int:
    """The bytes the plan carries for the tensor: all of it, or its patch."""
    if spec.encoding == "dense":
        return dense_nbytes(spec)
    value_bytes = spec.count * dtype_from_name(spec.dtype).itemsize
    if spec.encoding == "sparse":
        return spec.count * INDEX_BYTES + value_bytes
    if spec.encoding == "blocks":
        return value_bytes + 2 * -(-math.prod(spec.shape) // PATCH_BLOCK) + spec.count
    raise PlanError(f"tensor {spec.name!r} has an unknown encoding {spec.encoding!r}")


def _wire_dtype(meta: TensorMeta, cast: torch.dtype | Mapping[str, torch.dtype] | None) -> torch.dtype:
    if isinstance(cast, Mapping):
        return cast.get(meta.name, meta.dtype)
    # A blanket cast applies to floating-point tensors only: ints, bools and fp8 keep their dtype.
    if cast is not None and meta.dtype.is_floating_point and meta.dtype.itemsize > 1:
        return cast
    return meta.dtype


def wire_specs(
    metas: Sequence[TensorMeta], cast: torch.dtype | Mapping[str, torch.dtype] | None = None
) -> list[TensorSpec]:
    """Tensor specs as they travel, with the optional cast on send applied.

    Args:
        metas: the source's tensor metadata.
        cast: a dtype every floating-point tensor (2+ bytes per element) is sent as, or a
            mapping from name to the dtype that tensor is sent as.
    """
    if cast is not None and not isinstance(cast, (torch.dtype, Mapping)):
        raise ConfigError(f"cast must be a torch.dtype or a mapping of name to dtype, got {cast!r}")
    return [
        TensorSpec(
            meta.name, dtype_name(_wire_dtype(meta, cast)), tuple(int(d) for d in meta.shape), dtype_name(meta.dtype)
        )
        for meta in metas
    ]


def build_plan(specs: Sequence[TensorSpec], bucket_bytes: int) -> Plan:
    """Pack `specs` into buckets of `bucket_bytes` (a multiple of 64), chunking what does not fit."""
    buckets = pack_segments([(index, 0, tensor_nbytes(spec)) for index, spec in enumerate(specs)], bucket_bytes)
    total = sum(piece.nbytes for bucket in buckets for piece in bucket)
    return Plan(bucket_bytes=bucket_bytes, tensors=tuple(specs), buckets=tuple(buckets), total_bytes=total)


def pack_segments(segments: Sequence[tuple[int, int, int]], bucket_bytes: int) -> list[tuple[Piece, ...]]:
    """Pack byte runs `(tensor, offset, nbytes)` of tensors into buckets of `bucket_bytes`, in
    order (the module docstring's rule: each run starts on a 64-byte boundary, one that does not
    fit what is left starts a new bucket, one larger than a bucket is chunked)."""
    if bucket_bytes < ALIGN_BYTES or bucket_bytes % ALIGN_BYTES:
        raise ConfigError(f"bucket_bytes must be a positive multiple of {ALIGN_BYTES}, got {bucket_bytes}")
    buckets: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    fill = 0

    def close_bucket() -> None:
        nonlocal current, fill
        if current:
            buckets.append(tuple(current))
        current, fill = [], 0

    for index, first, nbytes in segments:
        start = align_up(fill)
        if nbytes > bucket_bytes - start and nbytes <= bucket_bytes:
            close_bucket()
            start = 0
        if nbytes <= bucket_bytes - start:
            current.append(Piece(index, first, start, nbytes))
            fill = start + nbytes
            continue
        offset = 0
        while offset < nbytes:
            start = align_up(fill)
            if start >= bucket_bytes:
                close_bucket()
                start = 0
            length = min(nbytes - offset, bucket_bytes - start)
            current.append(Piece(index, first + offset, start, length))
            offset += length
            fill = start + length
    close_bucket()
    return buckets


def plan_id(plan: Plan) -> str:
    """The plan's id: a hash of its canonical encoding, named by the offer and again by the commit."""
    return hashlib.blake2b(msgspec.msgpack.encode(plan), digest_size=16).hexdigest()


class PlanCache:
    """The sender's last plan and its id, reused while the tensors and the bucket size stay the
    same (a trainer pushes the same shapes every step: building and hashing a plan of hundreds
    of tensors costs milliseconds, as much as moving them on a GPU)."""

    def __init__(self) -> None:
        self._key: tuple[tuple[TensorSpec, ...], int] | None = None
        self._plan: Plan | None = None
        self._id = ""

    def build(self, specs: Sequence[TensorSpec], bucket_bytes: int) -> Plan:
        """`build_plan(specs, bucket_bytes)`, or the same plan as last time."""
        key = (tuple(specs), bucket_bytes)
        if self._plan is None or key != self._key:
            self._plan = build_plan(specs, bucket_bytes)
            self._key, self._id = key, plan_id(self._plan)
        return self._plan

    def plan_id(self, plan: Plan) -> str:
        """`plan_id(plan)`, known already for the plan `build` returned."""
        return self._id if plan is self._plan else plan_id(plan)


def check_plan(plan: Plan, max_bucket_bytes: int) -> None:
    """Validate a plan received from a peer before anything it asks for is allocated.

    Checks sizes, names, dtypes and that the pieces cover every tensor exactly once, inside their
    buckets without overlapping: in order, or, for a plan in parts (sharded sync), in order
    within each part and together covering every tensor.

    Raises:
        PlanError: with the first problem found.
    """
    if not 0 < plan.bucket_bytes <= max_bucket_bytes or plan.bucket_bytes % ALIGN_BYTES:
        raise PlanError(
            f"bucket size {plan.bucket_bytes} is not a multiple of {ALIGN_BYTES} in (0, {max_bucket_bytes}]"
        )
    if len(plan.tensors) > MAX_TENSORS:
        raise PlanError(f"plan has {len(plan.tensors)} tensors, more than the limit of {MAX_TENSORS}")
    sizes = [_checked_nbytes(spec) for spec in plan.tensors]
    if len({spec.name for spec in plan.tensors}) != len(plan.tensors):
        raise PlanError("plan names a tensor twice")
    if sum(sizes) != plan.total_bytes:
        raise PlanError(f"plan total_bytes {plan.total_bytes} != sum of tensor sizes {sum(sizes)}")
    if plan.parts:
        _check_parts(plan, sizes)
        return
    tensor, offset, started = 0, 0, False
    for bucket_index, bucket in enumerate(plan.buckets):
        bucket_end = 0
        if not bucket:
            raise PlanError(f"bucket {bucket_index} is empty")
        for piece in bucket:
            if started and offset == sizes[tensor]:
                tensor, offset, started = tensor + 1, 0, False
            if tensor >= len(sizes) or piece.tensor != tensor or piece.tensor_offset != offset:
                raise PlanError(
                    f"bucket {bucket_index}: piece {piece} breaks plan order (expected tensor {tensor} at {offset})"
                )
            bucket_end = _check_piece(plan, bucket_index, piece, sizes[tensor], bucket_end)
            offset += piece.nbytes
            started = True
    complete = not sizes or (started and tensor == len(sizes) - 1 and offset == sizes[tensor])
    if not complete:
        raise PlanError(
            f"plan leaves tensor {plan.tensors[min(tensor, len(sizes) - 1)].name!r} and those after it incomplete"
        )


def part_buckets(plan: Plan, part: int) -> range:
    """The buckets of part `part` of a plan (every bucket for a plan of one part)."""
    parts = plan.parts or (0,)
    if not 0 <= part < len(parts):
        raise PlanError(f"part {part} of a plan in {len(parts)} parts")
    return range(parts[part], parts[part + 1] if part + 1 < len(parts) else len(plan.buckets))


def _check_piece(plan: Plan, bucket_index: int, piece: Piece, size: int, bucket_end: int) -> int:
    """One piece of tensor bytes `size` lies inside its tensor and its bucket, after `bucket_end`
    (where the bucket's previous piece ended), and splits no element; where it ends."""
    if piece.nbytes < 0 or (piece.nbytes == 0 and size > 0) or piece.tensor_offset + piece.nbytes > size:
        raise PlanError(f"bucket {bucket_index}: piece {piece} is empty or runs past its tensor ({size} bytes)")
    if piece.bucket_offset < bucket_end or piece.bucket_offset + piece.nbytes > plan.bucket_bytes:
        raise PlanError(f"bucket {bucket_index}: piece {piece} overlaps or leaves the bucket")
    spec = plan.tensors[piece.tensor]
    element = dtype_from_name(spec.dtype).itemsize if spec.encoding == "dense" else 1  # a patch: raw bytes
    if piece.tensor_offset % element or piece.nbytes % element:
        raise PlanError(f"bucket {bucket_index}: piece {piece} splits an element of {element} bytes")
    return piece.bucket_offset + piece.nbytes


def _check_parts(plan: Plan, sizes: list[int]) -> None:
    """A plan in parts: each part's pieces in plan order, and all of them covering every tensor
    exactly once."""
    parts = plan.parts
    if len(parts) > MAX_PARTS or parts[0] != 0 or list(parts) != sorted(parts) or parts[-1] > len(plan.buckets):
        raise PlanError(f"plan parts {parts[:8]} do not split its {len(plan.buckets)} buckets in order")
    covered: dict[int, list[tuple[int, int]]] = {}
    for part in range(len(parts)):
        previous = (-1, -1)
        for bucket_index in part_buckets(plan, part):
            bucket_end = 0
            if not plan.buckets[bucket_index]:
                raise PlanError(f"bucket {bucket_index} is empty")
            for piece in plan.buckets[bucket_index]:
                if not 0 <= piece.tensor < len(sizes) or (piece.tensor, piece.tensor_offset) <= previous:
                    raise PlanError(f"bucket {bucket_index}: piece {piece} breaks the order of part {part}")
                if piece.tensor_offset < 0:
                    raise PlanError(f"bucket {bucket_index}: piece {piece} starts before its tensor")
                bucket_end = _check_piece(plan, bucket_index, piece, sizes[piece.tensor], bucket_end)
                previous = (piece.tensor, piece.tensor_offset)
                covered.setdefault(piece.tensor, []).append((piece.tensor_offset, piece.nbytes))
    for tensor, size in enumerate(sizes):
        runs = sorted(covered.get(tensor, []))
        ends = [offset + nbytes for offset, nbytes in runs]
        if (
            not runs
            or runs[0][0] != 0
            or ends[-1] != size
            or any(a != b for (a, _), b in zip(runs[1:], ends[:-1], strict=True))
        ):
            raise PlanError(f"the parts do not cover tensor {plan.tensors[tensor].name!r} exactly once")


def _checked_nbytes(spec: TensorSpec) -> int:
    if not spec.name or len(spec.name) > MAX_NAME_LENGTH:
        raise PlanError(f"tensor name of length {len(spec.name)} is empty or longer than {MAX_NAME_LENGTH}")
    # torch sizes a tensor in int64 even when a zero dimension makes it empty: a shape such as
    # (2**62, 2**62, 0) is 0 bytes here but makes torch.empty raise on the receiver, so the
    # product of the nonzero dimensions is bounded too.
    if (
        len(spec.shape) > MAX_DIMS
        or any(dim < 0 for dim in spec.shape)
        or math.prod(max(dim, 1) for dim in spec.shape) > MAX_ELEMENTS
    ):
        raise PlanError(f"tensor {spec.name!r} has an invalid shape {spec.shape}")
    dtype_from_name(spec.source_dtype)
    _check_encoding(spec)
    if spec.region is not None:
        _check_region(spec)
    return tensor_nbytes(spec)


def _check_region(spec: TensorSpec) -> None:
    """A box of a tensor lies inside it, and travels whole (never as a patch)."""
    start, whole = spec.region.start, spec.region.whole  # type: ignore[union-attr]
    inside = len(start) == len(whole) == len(spec.shape) and all(
        0 <= first and first + extent <= size for first, extent, size in zip(start, spec.shape, whole, strict=True)
    )
    if not inside or math.prod(max(dim, 1) for dim in whole) > MAX_ELEMENTS or spec.encoding != "dense":
        raise PlanError(f"tensor {spec.name!r}: box {spec.shape} at {start} does not fit its tensor {whole}")


def _check_encoding(spec: TensorSpec) -> None:
    if spec.encoding not in ENCODINGS:
        raise PlanError(f"tensor {spec.name!r} has an unknown encoding {spec.encoding!r}")
    numel = math.prod(spec.shape)
    if spec.encoding == "dense" and spec.count != 0:
        raise PlanError(f"dense tensor {spec.name!r} claims a patch of {spec.count} values")
    if not 0 <= spec.count <= numel:
        raise PlanError(f"tensor {spec.name!r} patches {spec.count} of its {numel} elements")
    if spec.encoding == "sparse" and numel >= 1 << 31:
        raise PlanError(f"tensor {spec.name!r} of {numel} elements is too large for int32 indices")
