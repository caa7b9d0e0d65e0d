"""The content digest of weights as a push would send them, computed where they are.

A verified push (`verify="bucket"` or `"full"`) ends with a content digest: xxh3-128 over the
plan's digest and every bucket's checksum. A server keeps the digest of the version it holds
(`/weight_info`). `source_digest` computes the same digest from the trainer's tensors or a
checkpoint on disk, without sending a byte, so that what a server holds can be checked against
what should be there (`weightsync digest`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from weightsync.checksum import bucket_checksum, content_digest
from weightsync.pack import piece_bytes, write_piece
from weightsync.plan import build_plan, plan_digest, wire_specs
from weightsync.sender import bucket_items
from weightsync.source import as_source

__all__ = ["source_digest"]


def source_digest(tensors: Any, bucket_bytes: int, cast: torch.dtype | Mapping[str, torch.dtype] | None = None) -> str:
    """The content digest a verified push of `tensors` with buckets of `bucket_bytes` (the size
    the push agreed on: a server reports it as `last_sync.bucket_bytes`) and `cast` would carry."""
    source = as_source(tensors)
    metas = source.metas()
    plan = build_plan(wire_specs(metas, cast), bucket_bytes)
    scratch = np.empty(plan.bucket_bytes, dtype=np.uint8)
    checksums = []
    for _, items in bucket_items(plan, metas, source.tensors()):
        views = []
        for item in items:
            piece = item.piece
            view = piece_bytes(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes)
            if view is None:
                view = scratch[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
                write_piece(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes, view)
            views.append(view)
        checksums.append(bucket_checksum(views))
    return content_digest(plan_digest(plan), checksums)
