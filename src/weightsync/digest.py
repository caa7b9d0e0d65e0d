"""The content digest of weights as a push would send them, computed where they are.

A verified push (`verify="bucket"` or `"full"`) ends with a content digest: xxh3-128 over every
tensor's name, wire dtype, shape and xxh3-64, in name order (checksum.py). It does not depend on
the order the tensors were pushed in, nor on how the push cut them into buckets. A server keeps the digest of the version it holds (`/weight_info`);
`source_digest` computes the same digest from the trainer's tensors or a checkpoint on disk,
without sending a byte, so that what a server holds can be checked against what should be there
(`weightsync digest`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from weightsync.checksum import content_digest
from weightsync.dtypes import dtype_from_name
from weightsync.pack import piece_bytes, write_piece
from weightsync.plan import tensor_nbytes, wire_specs
from weightsync.source import as_source

__all__ = ["source_digest"]


def source_digest(tensors: Any, cast: torch.dtype | Mapping[str, torch.dtype] | None = None) -> str:
    """The content digest a verified push of `tensors` with `cast` would carry, whatever its
    bucket size: each tensor hashed whole, in its wire dtype."""
    source = as_source(tensors)
    specs = wire_specs(source.metas(), cast)
    digests = []
    for spec, (_, tensor) in zip(specs, source.tensors(), strict=True):
        wire_dtype, nbytes = dtype_from_name(spec.dtype), tensor_nbytes(spec)
        view = piece_bytes(tensor, wire_dtype, 0, nbytes)
        if view is None:  # a cast, a GPU tensor or a strided one: converted once, on the host
            view = np.empty(nbytes, dtype=np.uint8)
            write_piece(tensor, wire_dtype, 0, nbytes, view)
        digests.append(xxhash.xxh3_64_intdigest(view.data))
    return content_digest(specs, digests)
