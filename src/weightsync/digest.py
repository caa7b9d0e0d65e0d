"""The content digest of weights as a push would send them, computed where they are.

A verified push (`verify="bucket"` or `"full"`) ends with a content digest: xxh3-128 over every
tensor's name, wire dtype, shape and CRC32C, in name order (checksum.py). It does not depend on
the order the tensors were pushed in, nor on how the push cut them into buckets. A server keeps the digest of the version it holds (`/weight_info`);
`source_digest` computes the same digest from the trainer's tensors or a checkpoint on disk,
without sending a byte, so that what a server holds can be checked against what should be there
(`weightsync digest`). `held_shares` is one trainer rank's part of it in a sharded push: what it
computes from the box of each tensor it holds, which the receivers combine with the other ranks'. A push that
needs one of these beside its buckets computes it on a thread of its own while they go out: a
`Pending` hash, which the commit waits for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from weightsync.checksum import HASH_TIMEOUT_S, content_digest, share, tensor_hash
from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.messages import TensorShare, TensorSpec
from weightsync.pack import piece_bytes, write_piece
from weightsync.plan import tensor_nbytes, wire_specs
from weightsync.regions import held_runs
from weightsync.source import Held, ShardedSource, SourceLayout, WeightSource, as_source

__all__ = ["Pending", "box_share", "held_shares", "rank_tensors", "source_digest"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Pending(Generic[T]):
    """A hash known now, or being computed on a thread of its own (the whole-model hash runs
    while a push's offer and buckets go out); `get` waits for it, bounded."""

    future: Future[T]

    @staticmethod
    def now(value: T) -> Pending[T]:
        """`value`, known already."""
        future: Future[T] = Future()
        future.set_result(value)
        return Pending(future)

    @staticmethod
    def later(compute: Callable[[], T]) -> Pending[T]:
        """`compute()`, started now on a thread that ends with it."""
        hashing = ThreadPoolExecutor(1, thread_name_prefix="weightsync-digest")
        try:
            return Pending(hashing.submit(compute))
        finally:
            hashing.shutdown(wait=False)

    def get(self) -> T:
        """The value, once computed (its error, if computing it failed)."""
        return self.future.result(timeout=HASH_TIMEOUT_S)


def source_digest(tensors: Any, cast: torch.dtype | Mapping[str, torch.dtype] | None = None) -> str:
    """The content digest a verified push of `tensors` with `cast` would carry, whatever its
    bucket size: each tensor hashed whole, in its wire dtype."""
    source = as_source(tensors)
    specs = wire_specs(source.metas(), cast)
    digests = [
        _hash(spec, tensor, tensor_nbytes(spec)) for spec, (_, tensor) in zip(specs, source.tensors(), strict=True)
    ]
    return content_digest(specs, digests)


def rank_tensors(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor as this rank holds it: a sharded source's `held`, any other's tensors (one
    rank holds them whole)."""
    return source.held() if isinstance(source, ShardedSource) else source.tensors()


def held_shares(
    source: WeightSource, layout: SourceLayout, cast: torch.dtype | Mapping[str, torch.dtype] | None = None
) -> tuple[TensorShare, ...]:
    """This rank's share of every tensor's hash in a sharded push (checksum.share): one share
    per run of bytes of the box it holds of a tensor (`regions.held_runs`), nothing of the
    others. Reads only what the rank holds; the receivers combine every rank's shares into the
    version's content digest."""
    specs = wire_specs(source.metas(), cast)
    return tuple(
        box_share(spec, layout.held[index][layout.rank], name, tensor)
        for index, (spec, (name, tensor)) in enumerate(zip(specs, rank_tensors(source), strict=True))
    )


def box_share(
    spec: TensorSpec, box: Held | None, name: str, tensor: torch.Tensor, crc: int | None = None
) -> TensorShare:
    """The share of tensor `spec`'s hash of the rank holding box `box` of it as `tensor`: its runs
    of bytes (`regions.held_runs`) hashed, each shifted past the bytes up to the next run's end.
    `crc`: the CRC32C of `tensor`'s bytes where already known, which spares hashing a box that
    is one run."""
    runs = held_runs(spec, box)
    if runs and tensor.numel() * dtype_from_name(spec.dtype).itemsize != sum(n for _, n in runs):
        raise PlanError(f"{name}: this rank holds {tuple(tensor.shape)}, not {_said(box)} {spec.shape}")
    if crc is not None and len(runs) == 1:
        first, nbytes = runs[0]
        return TensorShare(spec.name, spec.dtype, spec.shape, share(crc, tensor_nbytes(spec) - first - nbytes))
    held, end, sent = 0, 0, 0  # Horner: each run's hash shifted past the bytes up to the next run's end
    for first, nbytes in runs:
        held = share(held, first + nbytes - end) ^ _hash(spec, tensor, nbytes, sent)
        end, sent = first + nbytes, sent + nbytes
    return TensorShare(spec.name, spec.dtype, spec.shape, share(held, tensor_nbytes(spec) - end))


def _said(box: Held | None) -> str:
    """How an error names box `box` of a tensor."""
    if not box:
        return "the whole"
    return f"rows [{box[0][0]}, {box[0][1]}) of" if len(box) == 1 else f"the box {box} of"


def _hash(spec: TensorSpec, tensor: torch.Tensor, nbytes: int, first: int = 0) -> int:
    """The hash of `tensor`'s `nbytes` bytes from byte `first`, in `spec`'s wire dtype."""
    wire_dtype = dtype_from_name(spec.dtype)
    view = piece_bytes(tensor, wire_dtype, first, nbytes)
    if view is None:  # a cast, a GPU tensor or a strided one: converted once, on the host
        view = np.empty(nbytes, dtype=np.uint8)
        write_piece(tensor, wire_dtype, first, nbytes, view)
    return tensor_hash(view)
