"""Patches: a tensor's changed elements, encoded three ways, and written back in place.

    sparse   count int32 indices, then count values       4 + itemsize bytes per changed element
    blocks   count values, then per block of 256 elements  numel / 128 + (1 + itemsize) bytes
             its number of changes (uint16), then each     per changed element
             change's offset in its block (one byte)
    dense    every element                                 numel * itemsize

Blocks carry a changed bf16 element in 3 bytes where sparse takes 6; sparse is smaller only
below about one change in 384 elements.

A patch travels as an ordinary planned tensor whose `TensorSpec` carries its `encoding` and
`count`; `encode` picks the cheapest encoding on the sender (delta.py), `apply_patch` writes one
into its destination on the receiver (landing.py). Elements are compared and written by their
bits (NaN payloads, -0.0), natively where `_native/deltadiff.c` is built, else with numpy. The
native diff and blocks apply also hash the tensor they leave behind, in the same pass
(`crc_room`, `joined_crc`): neither side then reads the whole model again for the content digest.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from weightsync.checksum import share
from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.messages import TensorSpec
from weightsync.plan import INDEX_BYTES, PATCH_BLOCK, tensor_nbytes

__all__ = [
    "BITS",
    "NATIVE",
    "NATIVE_SIZES",
    "apply_patch",
    "crc_room",
    "element_bits",
    "encode",
    "joined_crc",
    "native_threads",
]

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype per element size: elements are compared by their bits (NaN payloads, -0.0)."""


_NP_BITS: dict[int, type[np.integer[Any]]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

NATIVE: types.ModuleType | None
try:
    from weightsync._native import deltadiff as NATIVE
except ImportError:  # built without a C compiler: numpy does the diff, several times slower
    NATIVE = None

NATIVE_SIZES = (2, 4)
"""Element sizes the native diff handles (bf16/fp16 and fp32/int32); others take numpy."""


def native_threads() -> int:
    """Threads for the native diff: torch's intra-op count, which the caller already tunes."""
    return max(1, torch.get_num_threads())


def crc_room() -> np.ndarray:
    """Where a native pass puts each of its threads' (CRC32C, bytes after its range) pairs."""
    return np.zeros(2 * (NATIVE.MAX_THREADS if NATIVE is not None else 1), dtype=np.uint64)


def joined_crc(crcs: np.ndarray) -> int:
    """The CRC32C of a whole tensor from its threads' pairs (`crc_room`): the XOR of their shares."""
    crc = 0
    for part, after in crcs.reshape(-1, 2).tolist():
        crc ^= share(part, after)
    return crc


def element_bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as integers of the same size, no copy (numpy)."""
    return tensor.reshape(-1).view(BITS[tensor.element_size()]).numpy()


def encode(
    indices: np.ndarray, values: np.ndarray, numel: int, spec: TensorSpec, alloc: Callable[[int], np.ndarray]
) -> tuple[TensorSpec, np.ndarray | None]:
    """The cheapest encoding of the changes (flat ascending `indices`, their new bits `values` as
    bytes) to a tensor of `numel` elements: the spec and payload (flat uint8, from
    `alloc(nbytes)`) of its patch, or None where the whole tensor is cheaper (dense)."""
    count = indices.size
    encoding = _cheapest(count, numel, spec)
    if encoding == "dense":
        return spec, None
    patched = msgspec.structs.replace(spec, encoding=encoding, count=count)
    payload = alloc(tensor_nbytes(patched))
    if encoding == "sparse":
        head = count * INDEX_BYTES
        payload[:head].view(np.int32)[:] = indices
        payload[head:] = values
        return patched, payload
    # blocks: values first (aligned in the payload), then the counts, then the offsets
    payload[: values.size] = values
    counts = payload[values.size : values.size + 2 * _blocks(numel)].view(np.uint16)
    offsets = payload[values.size + counts.nbytes :]
    if NATIVE is not None and indices.dtype == np.int32:
        NATIVE.block_offsets(indices, counts, offsets)
    else:
        counts[:] = np.bincount(indices // PATCH_BLOCK, minlength=counts.size)
        offsets[:] = indices % PATCH_BLOCK
    return patched, payload


def _cheapest(count: int, numel: int, spec: TensorSpec) -> str:
    """The encoding of a patch changing `count` of a tensor's `numel` elements."""
    return min(_sizes(count, numel, spec).items(), key=lambda item: item[1])[0]


def _sizes(count: int, numel: int, spec: TensorSpec) -> dict[str, float]:
    sizes: dict[str, float] = {
        encoding: tensor_nbytes(msgspec.structs.replace(spec, encoding=encoding, count=count))
        for encoding in ("sparse", "blocks")
    }
    sizes["dense"] = tensor_nbytes(spec)
    if numel >= 1 << 31:  # int32 indices
        sizes["sparse"] = math.inf
    return sizes


def _blocks(numel: int) -> int:
    return -(-numel // PATCH_BLOCK)


def apply_patch(dest: torch.Tensor, spec: TensorSpec, payload: torch.Tensor) -> int | None:
    """Write the patch `payload` (its uint8 bytes, as planned by `spec`) into `dest` in place; the
    CRC32C of `dest` as it then is, where the native blocks apply hashed it on the way, else None.

    Raises:
        PlanError: the payload names elements outside the tensor, or its blocks' counts disagree
            with its count (a corrupted or hostile patch; checksums catch corruption first).
    """
    numel, count = math.prod(spec.shape), spec.count
    payload = payload.reshape(-1)
    if payload.numel() != tensor_nbytes(spec):
        raise PlanError(f"patch of {spec.name!r} is {payload.numel()} bytes, its plan says {tensor_nbytes(spec)}")
    if count == 0:
        return None
    raw = payload.numpy()
    bits = _NP_BITS[dtype_from_name(spec.dtype).itemsize]
    if spec.encoding == "sparse":
        head = count * INDEX_BYTES
        where = _aligned(raw[:head], np.int32)
        values = _aligned(raw[head:], bits)
        if int(where.min()) < 0 or int(where.max()) >= numel:
            raise PlanError(f"patch of {spec.name!r} names elements outside its {numel}")
        _scatter(dest, where, values)
        return None
    values = _aligned(raw[: count * np.dtype(bits).itemsize], bits)
    counts = _aligned(raw[values.nbytes : values.nbytes + 2 * _blocks(numel)], np.uint16)
    offsets = raw[values.nbytes + counts.nbytes :]
    if dest.device.type == "cpu" and NATIVE is not None and dest.element_size() in NATIVE_SIZES:
        crcs = crc_room()
        try:
            NATIVE.apply_blocks(
                element_bits(dest), dest.element_size(), counts, offsets, values, native_threads(), crcs
            )
        except IndexError as exc:
            raise PlanError(f"patch of {spec.name!r}: {exc}") from None
        return joined_crc(crcs)
    if int(counts.sum()) != count or int(counts.max()) > PATCH_BLOCK:
        raise PlanError(f"patch of {spec.name!r}: its blocks count {int(counts.sum())} changes, its plan says {count}")
    where = np.repeat(np.arange(counts.size, dtype=np.int64) * PATCH_BLOCK, counts) + offsets
    if where.size and int(where.max()) >= numel:
        raise PlanError(f"patch of {spec.name!r} names elements outside its {numel}")
    _scatter(dest, where, values)
    return None


def _scatter(dest: torch.Tensor, where: np.ndarray, values: np.ndarray) -> None:
    """dest[where] = values, by bits: natively on the CPU where built (numpy converts int32
    indices to int64 first)."""
    if dest.device.type != "cpu":
        flat = dest.view(-1).view(BITS[dest.element_size()])
        flat[torch.from_numpy(where.astype(np.int64)).to(dest.device)] = torch.from_numpy(values).to(dest.device)
    elif NATIVE is not None and where.dtype == np.int32 and dest.element_size() in NATIVE_SIZES:
        NATIVE.apply(element_bits(dest), dest.element_size(), where, values, native_threads())
    else:
        np.put(element_bits(dest), where, values)


def _aligned(raw: np.ndarray, dtype: type[np.integer[Any]]) -> np.ndarray:
    """Bytes as elements of `dtype`: a view where they are aligned for it, else an aligned copy."""
    aligned = raw.ctypes.data % np.dtype(dtype).itemsize == 0
    return (raw if aligned else raw.copy()).view(dtype)
