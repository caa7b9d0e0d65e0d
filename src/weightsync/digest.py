"""The content digest of weights as a push would send them, computed where they are.

A verified push (`verify="bucket"` or `"full"`) ends with a content digest: xxh3-128 over every
tensor's name, wire dtype, shape and CRC32C, in name order (checksum.py). It does not depend on
the order the tensors were pushed in, nor on how the push cut them into buckets. A server keeps the digest of the version it holds (`/weight_info`);
`source_digest` computes the same digest from the trainer's tensors or a checkpoint on disk,
without sending a byte, so that what a server holds can be checked against what should be there
(`weightsync digest`). `held_shares` is one trainer rank's part of it in a sharded push: what it
computes from the rows it holds, which the receivers combine with the other ranks'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from weightsync.checksum import content_digest, share, tensor_hash
from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.messages import TensorShare, TensorSpec
from weightsync.pack import piece_bytes, write_piece
from weightsync.plan import tensor_nbytes, wire_specs
from weightsync.regions import held_range
from weightsync.source import ShardedSource, SourceLayout, as_source

__all__ = ["held_shares", "source_digest"]


def source_digest(tensors: Any, cast: torch.dtype | Mapping[str, torch.dtype] | None = None) -> str:
    """The content digest a verified push of `tensors` with `cast` would carry, whatever its
    bucket size: each tensor hashed whole, in its wire dtype."""
    source = as_source(tensors)
    specs = wire_specs(source.metas(), cast)
    digests = [
        _hash(spec, tensor, tensor_nbytes(spec)) for spec, (_, tensor) in zip(specs, source.tensors(), strict=True)
    ]
    return content_digest(specs, digests)


def held_shares(
    source: ShardedSource, layout: SourceLayout, cast: torch.dtype | Mapping[str, torch.dtype] | None = None
) -> tuple[TensorShare, ...]:
    """This rank's share of every tensor's hash in a sharded push (checksum.share): its rows of
    a tensor split by rows, a whole tensor it sends, nothing of the others. Reads only what the
    rank holds; the receivers combine every rank's shares into the version's content digest."""
    specs = wire_specs(source.metas(), cast)
    shares = []
    for index, (spec, (name, tensor)) in enumerate(zip(specs, source.held(), strict=True)):
        bounds = layout.rows[index]
        first, end = held_range(spec, bounds, layout.rank, layout.owner(index))
        held = 0
        if end > first:
            if tensor.numel() * dtype_from_name(spec.dtype).itemsize != end - first:
                rows = "the whole" if bounds is None else f"rows [{bounds[layout.rank]}, {bounds[layout.rank + 1]}) of"
                raise PlanError(f"{name}: this rank holds {tuple(tensor.shape)}, not {rows} {spec.shape}")
            held = _hash(spec, tensor, end - first)
        shares.append(TensorShare(spec.name, spec.dtype, spec.shape, share(held, tensor_nbytes(spec) - end)))
    return tuple(shares)


def _hash(spec: TensorSpec, tensor: torch.Tensor, nbytes: int) -> int:
    """The hash of `tensor`'s `nbytes` bytes in `spec`'s wire dtype."""
    wire_dtype = dtype_from_name(spec.dtype)
    view = piece_bytes(tensor, wire_dtype, 0, nbytes)
    if view is None:  # a cast, a GPU tensor or a strided one: converted once, on the host
        view = np.empty(nbytes, dtype=np.uint8)
        write_piece(tensor, wire_dtype, 0, nbytes, view)
    return tensor_hash(view)
