"""The slice plan of a sharded sync: boxes of tensors, which box each sender holds, and the plan
one receiver is sent.

    Want, Region (messages.py)  the box of a tensor a receiver keeps; where a box sits in its tensor
    SourceLayout (source.py)    which box of each tensor each trainer rank holds
    checked_wants               a receiver's wants, checked against the tensors pushed
    receiver_specs              what a receiver is sent: its box of each tensor, or the whole tensor
    cuts                        the receivers grouped by what they keep, with what each group is sent
    part_plan                   the plan for one receiver: its boxes in buckets, one part per rank
    held_runs                   the runs of bytes of one box that one rank holds
    sent_whole                  the tensors a receiver keeping boxes is sent whole (it named none)

What one rank holds of a box is a box too, the intersection of the two: runs of the box's bytes
in its row-major layout (one run where the rank holds rows, one per row where it holds columns),
so a part is ordinary pieces (`tensor`, `tensor_offset`, ...) of the box: every data plane moves
it unchanged, and no receiver knows how the trainer was split. A rank's runs of a tensor, in
order, are its intersection's bytes in row-major order: it sends them from one view of what it
holds. Everything here is pure and the same on every rank: every sender computes the same plan for a receiver, and the
receiver checks that all of them offer it (`Offer.plan_id`).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping, Sequence

import msgspec
import torch

from weightsync.errors import PlanError
from weightsync.messages import Piece, Plan, Region, TensorSpec, Want
from weightsync.plan import pack_segments, tensor_nbytes
from weightsync.source import Held, SourceLayout

__all__ = [
    "Box",
    "checked_wants",
    "cuts",
    "held_runs",
    "part_plan",
    "receiver_specs",
    "region_view",
    "sent_whole",
    "whole_shape",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(start, stop) along each dimension: elements [start[d], stop[d])."""


def checked_wants(wants: Sequence[Want], specs: Sequence[TensorSpec]) -> dict[str, Box]:
    """A receiver's wants as boxes by name, checked against the tensors pushed: a box of an
    unknown tensor, of another rank, or outside its tensor is refused; a box of the whole tensor
    is left out (the tensor is sent whole anyway).

    Raises:
        PlanError: naming the first bad box.
    """
    shapes = {spec.name: spec.shape for spec in specs}
    boxes: dict[str, Box] = {}
    for want in wants:
        shape = shapes.get(want.name)
        if shape is None:
            continue  # a tensor this push does not carry (another model's name): nothing to cut
        dims = (want.start, want.stop, shape)
        if len({len(dim) for dim in dims}) != 1 or any(
            not 0 <= a <= b <= n for a, b, n in zip(want.start, want.stop, shape, strict=True)
        ):
            raise PlanError(f"the receiver wants {want.start}..{want.stop} of {want.name!r}, a tensor of {shape}")
        if want.name in boxes:
            raise PlanError(f"the receiver wants {want.name!r} twice")
        if (want.start, want.stop) != ((0,) * len(shape), shape):
            boxes[want.name] = (want.start, want.stop)
    return boxes


def receiver_specs(specs: Sequence[TensorSpec], boxes: Mapping[str, Box]) -> list[TensorSpec]:
    """What a receiver that keeps `boxes` is sent: the box of each tensor it names (a spec with
    a `region`), every other tensor whole."""
    found = []
    for spec in specs:
        box = boxes.get(spec.name)
        if box is None:
            found.append(spec)
            continue
        start, stop = box
        extents = tuple(b - a for a, b in zip(start, stop, strict=True))
        found.append(msgspec.structs.replace(spec, shape=extents, region=Region(start, spec.shape)))
    return found


def whole_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape of the tensor `spec` carries (or carries a box of)."""
    return spec.region.whole if spec.region is not None else spec.shape


def region_view(tensor: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The box of `tensor` (the whole tensor) that `spec` carries, as a view; `tensor` itself for
    a spec of the whole tensor."""
    if spec.region is None:
        return tensor
    return tensor[
        tuple(slice(first, first + extent) for first, extent in zip(spec.region.start, spec.shape, strict=True))
    ]


def held_runs(spec: TensorSpec, held: Held | None) -> list[tuple[int, int]]:
    """The runs of bytes `(first, nbytes)` of `spec` (a whole tensor, or a box of one) that a
    rank holding box `held` of the tensor holds, in order: its box's intersection with `spec`'s,
    one run per row of the intersection along the dimensions it does not span whole."""
    if held is None:
        return []
    shape = spec.shape
    start = spec.region.start if spec.region is not None else (0,) * len(shape)
    low, high = [], []
    for dim, extent in enumerate(shape):
        first, stop = held[dim] if dim < len(held) else (start[dim], start[dim] + extent)
        low.append(min(max(first - start[dim], 0), extent))
        high.append(min(max(stop - start[dim], 0), extent))
    if any(b <= a for a, b in zip(low, high, strict=True)):
        return []
    nbytes = tensor_nbytes(spec)
    split = max((dim for dim in range(len(shape)) if (low[dim], high[dim]) != (0, shape[dim])), default=-1)
    if split < 0:
        return [(0, nbytes)]
    element = nbytes // math.prod(shape)
    inner = math.prod(shape[split + 1 :])
    strides = [math.prod(shape[dim + 1 :]) for dim in range(split + 1)]
    run = (high[split] - low[split]) * inner * element
    rows = itertools.product(*(range(low[dim], high[dim]) for dim in range(split)))
    return [(sum(map(operator.mul, (*row, low[split]), strides)) * element, run) for row in rows]


def part_plan(specs: Sequence[TensorSpec], layout: SourceLayout, bucket_bytes: int) -> Plan:
    """The plan for one receiver sent `specs` (`receiver_specs`) by the ranks of `layout`: the
    buckets of part m carry the runs of bytes rank m holds (`held_runs`), in tensor order; one
    part for one sender. A tensor of no bytes travels as one empty piece in the first part.

    Raises:
        PlanError: `layout` does not describe `specs`, or its boxes do not cover a tensor once.
    """
    if len(layout.held) != len(specs):
        raise PlanError(f"the source's layout names {len(layout.held)} tensors, the push {len(specs)}")
    runs = [
        [held_runs(spec, boxes[rank]) for spec, boxes in zip(specs, layout.held, strict=True)]
        for rank in range(layout.world)
    ]
    for index, spec in enumerate(specs):
        if sum(n for rank in range(layout.world) for _, n in runs[rank][index]) != tensor_nbytes(spec):
            raise PlanError(f"the trainer ranks' boxes {layout.held[index]} do not cover {spec.name!r} once")
    buckets: list[tuple[Piece, ...]] = []
    parts = []
    for rank in range(layout.world):
        parts.append(len(buckets))
        segments = []
        for index, spec in enumerate(specs):
            if rank == 0 and tensor_nbytes(spec) == 0:
                segments.append((index, 0, 0))
            segments += [(index, first, nbytes) for first, nbytes in runs[rank][index]]
        buckets += pack_segments(segments, bucket_bytes)
    total = sum(tensor_nbytes(spec) for spec in specs)
    return Plan(bucket_bytes, tuple(specs), tuple(buckets), total, tuple(parts) if layout.world > 1 else ())


def cuts(
    specs: Sequence[TensorSpec], wants: Mapping[str, Sequence[Want]]
) -> tuple[list[tuple[frozenset[str], list[TensorSpec]]], dict[str, PlanError]]:
    """The receivers (by address, each with its `Welcome.wants`) grouped by what they keep, with
    what each group is sent (`receiver_specs`), and the receivers whose wants are refused (why).
    Groups come in the order of their first receiver."""
    groups: dict[tuple[tuple[str, Box], ...], list[str]] = {}
    refused: dict[str, PlanError] = {}
    for address, wanted in wants.items():
        try:
            boxes = checked_wants(wanted, specs)
        except PlanError as exc:
            refused[address] = exc
            continue
        groups.setdefault(tuple(sorted(boxes.items())), []).append(address)
    return [(frozenset(addresses), receiver_specs(specs, dict(key))) for key, addresses in groups.items()], refused


def sent_whole(specs: Sequence[TensorSpec], wants: Mapping[str, Sequence[Want]]) -> tuple[str, ...]:
    """The tensors some receiver that keeps boxes of tensors is sent whole, because it did not
    name them (its engine's loaders could not be dry-run for them: reads.py)."""
    whole: set[str] = set()
    for wanted in wants.values():
        named = {want.name for want in wanted}
        if named:
            whole.update(spec.name for spec in specs if spec.name not in named)
    return tuple(sorted(whole))
