"""Checksums: what `verify="bucket"` and `"full"` check, and the content digest of a version.

With verify="bucket", the sender hashes each piece of a bucket as packed (CRC32C, in hardware:
about 12 GB/s on one core here) and sends the bucket's checksum, an xxh3-64 of its pieces'
hashes, with the bucket. The receiver hashes the same bytes where they landed, before any tensor
of the bucket reaches the sink, and fails the sync on a mismatch: one extra read of every byte on
each side.

The same piece hashes give each tensor's hash (the CRC32C of its bytes as sent: the piece hash
when the tensor is one piece, a running CRC over its pieces when it is chunked), and the tensor
hashes give the content digest of the whole version: xxh3-128 over every tensor's name, dtype,
shape and hash. It does not depend on the bucket layout, so `source_digest` recomputes it from a
checkpoint without knowing how a push was cut. A CRC composes: the hash of a tensor is the XOR of
its parts' hashes, each shifted past the bytes that follow it (`share`), so the trainer ranks of
a sharded push, each hashing only the rows it holds, give the digest of the same version pushed
whole.

With verify="full", the receiver also re-hashes every tensor where it finally sits (its
destination, or the complete tensor handed to the sink) just before the commit: that catches a
bug that put correct bytes in the wrong place. Verification is off by default, and a receiver
can require it (the stricter side wins). `inproc` copies in one process and has no wire: it
sends no checksum.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeAlias

import crc32c
import numpy as np
import xxhash

from weightsync.errors import ChecksumError, ConfigError
from weightsync.messages import Piece, Plan, TensorShare, TensorSpec
from weightsync.plan import tensor_nbytes

__all__ = [
    "VERIFY_MODES",
    "SyncHashes",
    "Verify",
    "bucket_checksum",
    "check_verify",
    "combine_shares",
    "content_digest",
    "share",
    "stricter",
    "tensor_hash",
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
    return max(modes, key=VERIFY_MODES.index)


def bucket_checksum(piece_hashes: Sequence[int]) -> int:
    """A bucket's checksum: xxh3-64 over its pieces' hashes, in order."""
    return xxhash.xxh3_64_intdigest(np.asarray(piece_hashes, dtype="<u8").tobytes())


def tensor_hash(view: np.ndarray, running: int = 0) -> int:
    """The CRC32C of `view` (a uint8 array in host memory); with `running`, the CRC32C of the
    bytes that gave `running` followed by `view`'s. Releases the GIL on large views."""
    return int(crc32c.crc32c(view.data, running))


def piece_hashes(views: Iterable[np.ndarray]) -> list[int]:
    return [tensor_hash(view) for view in views]


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads hashing whole models (crc32c releases the GIL): the delta push's two whole-model
hashes, the sender's content digest and the receiver's check, sit on its critical path."""
HASH_TIMEOUT_S = 600.0
"""A bound on one whole-model hash (a 100 GB model at a crawl of 0.2 GB/s), so that no wait is
unbounded."""


def tensor_hashes(views: Sequence[np.ndarray]) -> list[int]:
    """The hash of each of `views` (uint8 arrays in host memory), in order, over `HASH_THREADS`
    threads (started per call: a model's worth of hashing dwarfs starting them, and none lingers)."""
    if len(views) < 2 or HASH_THREADS == 1:
        return piece_hashes(views)
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="weightsync-hash") as hashers:
        return list(hashers.map(tensor_hash, views, timeout=HASH_TIMEOUT_S))


def content_digest(specs: Sequence[TensorSpec | TensorShare], tensor_hashes: Sequence[int]) -> str:
    """One digest of a whole version, a value of its named tensors: xxh3-128 over every tensor's
    name, wire dtype, shape and hash, taken in name order. Independent of the order a source
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
        self._chunked = {tensor: 0 for tensor, count in num_pieces.items() if count > 1}
        empty = tensor_hash(np.empty(0, np.uint8))  # a tensor of no bytes at all: no piece goes by
        self._tensor_hashes = [None if t in num_pieces else empty for t in range(len(plan.tensors))]

    def bucket(self, pieces: Sequence[Piece], views: Sequence[np.ndarray]) -> int:
        """Hash bucket `len(self.checksums)`'s bytes (`views`, one per piece); its checksum."""
        hashes = piece_hashes(views)
        for piece, view, piece_hash in zip(pieces, views, hashes, strict=True):
            running = self._chunked.get(piece.tensor)
            if running is None:
                self._tensor_hashes[piece.tensor] = piece_hash
                continue
            running = self._chunked[piece.tensor] = tensor_hash(view, running)
            if piece.tensor_offset + piece.nbytes == tensor_nbytes(self.plan.tensors[piece.tensor]):
                self._tensor_hashes[piece.tensor] = running
        checksum = bucket_checksum(hashes)
        self.checksums.append(checksum)
        return checksum

    @property
    def complete(self) -> bool:
        """Whether every bucket of the plan went by."""
        return len(self.checksums) == len(self.plan.buckets)

    def tensor_hashes(self) -> tuple[int, ...]:
        """Each tensor's hash, in plan order (once `complete`)."""
        return tuple(-1 if value is None else value for value in self._tensor_hashes)

    def content_digest(self) -> str:
        """The content digest of the sync (once `complete`)."""
        return content_digest(self.plan.tensors, self.tensor_hashes())


def share(part_hash: int, after_nbytes: int) -> int:
    """A part's share of its tensor's hash: `part_hash` (the CRC32C of the part's bytes) shifted
    past the `after_nbytes` bytes of the tensor that follow the part. The XOR of every part's
    share is the CRC32C of the whole tensor, whoever hashed each part."""
    return _multiply(_x_to_8n(after_nbytes), part_hash) if part_hash else 0


def combine_shares(parts: Sequence[Sequence[TensorShare]]) -> str:
    """The content digest of a version from every sender's shares of its tensors (each sender
    lists every tensor, a share of 0 for bytes it did not hash)."""
    first = parts[0]
    names = [(entry.name, entry.dtype, entry.shape) for entry in first]
    hashes = [0] * len(first)
    for index, entries in enumerate(parts):
        if [(entry.name, entry.dtype, entry.shape) for entry in entries] != names:
            raise ChecksumError(f"the senders of parts 0 and {index} hashed different tensors")
        for position, entry in enumerate(entries):
            hashes[position] ^= entry.share
    return content_digest(first, hashes)


# CRC32C arithmetic (the Castagnoli polynomial, bits reflected as the CRC computes them): a CRC
# of bytes A followed by n bytes B is crc(A) * x^(8n) + crc(B) modulo the polynomial.
_POLYNOMIAL = 0x82F63B78
_ONE = 1 << 31
"""x^0 in the reflected representation."""


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial."""
    product, bit = 0, _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLYNOMIAL if b & 1 else b >> 1
    return product


def _powers() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, k = 0..63."""
    power, powers = _ONE >> 1, []  # x^1
    for _ in range(64):
        powers.append(power)
        power = _multiply(power, power)
    return tuple(powers)


_X_TO_2_TO_K = _powers()


@functools.lru_cache(maxsize=4096)
def _x_to_8n(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what shifts a CRC past `nbytes` bytes."""
    if nbytes < 0:
        raise ValueError(f"{nbytes} bytes")
    power, exponent, k = _ONE, nbytes * 8, 0
    while exponent:
        if exponent & 1:
            power = _multiply(_X_TO_2_TO_K[k], power)
        exponent >>= 1
        k += 1
    return power
