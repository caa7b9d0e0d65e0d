"""Checksums: what `verify="bucket"` and `"full"` check, and the content digest of a version.

With verify="bucket", the sender hashes each piece of a bucket as packed (xxh3-64, about 10 GB/s
on one core here) and sends the bucket's checksum, a hash of its pieces' hashes, with the bucket.
The receiver hashes the same bytes where they landed, before any tensor of the bucket reaches
the sink, and fails the sync on a mismatch: one extra read of every byte on each side.

The same piece hashes give each tensor's hash (xxh3-64 of its bytes as sent: the piece hash
when the tensor is one piece, a running hash over its pieces when it is chunked), and the
tensor hashes give the content digest of the whole version: xxh3-128 over every tensor's
name, dtype, shape and hash. It does not depend on the bucket layout, so `source_digest`
recomputes it from a checkpoint without knowing how a push was cut.

With verify="full", the receiver also re-hashes every tensor where it finally sits (its
destination, or the complete tensor handed to the sink) just before the commit: that catches a
bug that put correct bytes in the wrong place. Verification is off by default, and a receiver
can require it (the stricter side wins). `inproc` copies in one process and has no wire: it
sends no checksum.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeAlias

import numpy as np
import xxhash

from weightsync.errors import ConfigError
from weightsync.messages import Piece, Plan, TensorSpec
from weightsync.plan import tensor_nbytes

__all__ = [
    "VERIFY_MODES",
    "SyncHashes",
    "Verify",
    "bucket_checksum",
    "check_verify",
    "content_digest",
    "stricter",
    "tensor_hashes",
]

Verify: TypeAlias = Literal["off", "bucket", "full"]
VERIFY_MODES: tuple[Verify, ...] = ("off", "bucket", "full")
"""Weakest first. "full" also re-hashes every tensor where it finally sits before the commit."""


def check_verify(mode: object) -> Verify:
    for verify in VERIFY_MODES:
        if mode == verify:
            return verify
    raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")


def stricter(*modes: Verify) -> Verify:
    """The strictest of `modes`."""
    return max(modes, key=VERIFY_MODES.index)


def bucket_checksum(piece_hashes: Sequence[int]) -> int:
    """A bucket's checksum: xxh3-64 over its pieces' xxh3-64 hashes, in order."""
    return xxhash.xxh3_64_intdigest(np.asarray(piece_hashes, dtype="<u8").tobytes())


def piece_hashes(views: Iterable[np.ndarray]) -> list[int]:
    """xxh3-64 of each of `views` (uint8 arrays in host memory)."""
    return [_hash(view) for view in views]


def _hash(view: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(view.data)


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads hashing whole models (xxhash releases the GIL): the delta push's two whole-model
hashes, the sender's content digest and the receiver's check, sit on its critical path."""
HASH_TIMEOUT_S = 600.0
"""A bound on one whole-model hash (a 100 GB model at a crawl of 0.2 GB/s), so that no wait is
unbounded."""


def tensor_hashes(views: Sequence[np.ndarray]) -> list[int]:
    """xxh3-64 of each of `views` (uint8 arrays in host memory), in order, over `HASH_THREADS`
    threads (started per call: a model's worth of hashing dwarfs starting them, and none lingers)."""
    if len(views) < 2 or HASH_THREADS == 1:
        return piece_hashes(views)
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="weightsync-hash") as hashers:
        return list(hashers.map(_hash, views, timeout=HASH_TIMEOUT_S))


def content_digest(specs: Sequence[TensorSpec], tensor_hashes: Sequence[int]) -> str:
    """One digest of a whole version, a value of its named tensors: xxh3-128 over every tensor's
    name, wire dtype, shape and xxh3-64, taken in name order. Independent of the order a source
    yields the tensors in and of the bucket layout; both sides compute it, so a trainer can check
    what a server holds against what it sent (or against a checkpoint on disk, whose tensors come
    in another order) without moving the weights again."""
    digest = xxhash.xxh3_128()
    for spec, tensor_hash in sorted(zip(specs, tensor_hashes, strict=True), key=lambda entry: entry[0].name):
        digest.update(f"{spec.name}\0{spec.dtype}\0{','.join(map(str, spec.shape))}\0".encode())
        digest.update(tensor_hash.to_bytes(8, "little"))
    return digest.hexdigest()


class SyncHashes:
    """One sync's hashes on one side, fed one bucket at a time in plan order: each bucket's
    checksum and, once its last piece went by, each tensor's hash."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.checksums: list[int] = []
        num_pieces = Counter(piece.tensor for bucket in plan.buckets for piece in bucket)
        self._chunked = {tensor: xxhash.xxh3_64() for tensor, count in num_pieces.items() if count > 1}
        self._tensor_hashes: list[int | None] = [None] * len(plan.tensors)
        for tensor in range(len(plan.tensors)):
            if tensor not in num_pieces:  # no bytes at all (an empty tensor): no piece goes by
                self._tensor_hashes[tensor] = xxhash.xxh3_64_intdigest(b"")

    def bucket(self, pieces: Sequence[Piece], views: Sequence[np.ndarray]) -> int:
        """Hash bucket `len(self.checksums)`'s bytes (`views`, one per piece); its checksum."""
        hashes = piece_hashes(views)
        for piece, view, piece_hash in zip(pieces, views, hashes, strict=True):
            running = self._chunked.get(piece.tensor)
            if running is None:
                self._tensor_hashes[piece.tensor] = piece_hash
                continue
            running.update(view.data)
            if piece.tensor_offset + piece.nbytes == _nbytes(self.plan, piece.tensor):
                self._tensor_hashes[piece.tensor] = running.intdigest()
        checksum = bucket_checksum(hashes)
        self.checksums.append(checksum)
        return checksum

    @property
    def complete(self) -> bool:
        """Whether every bucket of the plan went by."""
        return len(self.checksums) == len(self.plan.buckets)

    def tensor_hashes(self) -> tuple[int, ...]:
        """Each tensor's xxh3-64, in plan order (once `complete`)."""
        return tuple(-1 if value is None else value for value in self._tensor_hashes)

    def content_digest(self) -> str:
        """The content digest of the sync (once `complete`)."""
        return content_digest(self.plan.tensors, self.tensor_hashes())


def _nbytes(plan: Plan, tensor: int) -> int:
    return tensor_nbytes(plan.tensors[tensor])
