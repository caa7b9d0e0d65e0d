"""Bucket checksums: what `verify="bucket"` checks.

With verify="bucket", the sender hashes each bucket's bytes in plan order (xxh3-64, about 10 GB/s on one core here) and
sends the hash with the bucket. The receiver hashes the same bytes where they landed, before any
tensor of the bucket reaches the sink, and fails the sync on a mismatch. The cost is one extra
read of every byte on each side. With verify="full", both sides also hash each whole tensor:
the sender as it sends the tensor's pieces, the receiver where the tensor finally sits (its
destination, or the complete tensor handed to the sink), just before the commit. That catches
a bug that put correct bytes in the wrong place. Verification is off by default, and a receiver
can require it (the stricter side wins). `inproc` copies in one process and has no wire: it sends no checksum.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

from weightsync.errors import ConfigError

__all__ = ["VERIFY_MODES", "TensorHashes", "bucket_checksum", "check_verify", "content_digest", "stricter"]

VERIFY_MODES = ("off", "bucket", "full")
"""Weakest first. "full" also re-hashes every tensor where it finally sits before the commit."""


def check_verify(mode: object) -> str:
    if mode not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def stricter(*modes: str) -> str:
    """The strictest of `modes` (each one of VERIFY_MODES)."""
    return max(modes, key=VERIFY_MODES.index)


def bucket_checksum(views: Iterable[np.ndarray]) -> int:
    """xxh3-64 of the concatenated bytes of `views` (uint8 arrays)."""
    digest = xxhash.xxh3_64()
    for view in views:
        digest.update(view)
    return digest.intdigest()


def content_digest(plan_digest: str, checksums: list[int]) -> str:
    """One digest of a whole verified sync: the plan (names, dtypes, shapes, layout) and every
    bucket's checksum, in order. Both sides compute it, so a trainer can check what a server
    holds against what it sent without moving the weights again."""
    digest = xxhash.xxh3_128(plan_digest.encode())
    for checksum in checksums:
        digest.update(checksum.to_bytes(8, "little"))
    return digest.hexdigest()


class TensorHashes:
    """xxh3-64 of each tensor's bytes, fed piece by piece in plan order (verify="full")."""

    def __init__(self, num_tensors: int) -> None:
        self._hashes = [xxhash.xxh3_64() for _ in range(num_tensors)]

    def update(self, tensor: int, view: np.ndarray) -> None:
        self._hashes[tensor].update(view)

    def digests(self) -> tuple[int, ...]:
        return tuple(h.intdigest() for h in self._hashes)
