"""Patches: a tensor's changed elements, encoded three ways, and written back in place.

    sparse   count int32 indices, then count values      4 + itemsize bytes per changed element
    bitmap   one bit per element, then count values       numel / 8 + itemsize per changed element
    dense    every element                                numel * itemsize

A patch travels as an ordinary planned tensor whose `TensorSpec` carries its `encoding` and
`count`; `encode` picks the cheapest encoding on the sender (delta.py), `apply_patch` writes one
into its destination on the receiver (landing.py). Elements are compared and written by their
bits (NaN payloads, -0.0), natively where `_native/deltadiff.c` is built, else with numpy.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.messages import TensorSpec
from weightsync.plan import INDEX_BYTES, dense_nbytes, tensor_nbytes

__all__ = ["BITS", "NATIVE", "NATIVE_SIZES", "apply_patch", "element_bits", "encode", "native_threads"]

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


def element_bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as integers of the same size, no copy (numpy)."""
    return tensor.reshape(-1).view(BITS[tensor.element_size()]).numpy()


def encode(
    indices: np.ndarray, values: np.ndarray, numel: int, spec: TensorSpec, alloc: Callable[[int], np.ndarray]
) -> tuple[TensorSpec, np.ndarray | None]:
    """The cheapest encoding of the changes (flat `indices`, their new bits `values` as bytes) to a
    tensor of `numel` elements: the spec and payload (flat uint8, from `alloc(nbytes)`) of its
    patch, or None where the whole tensor is cheaper (dense)."""
    count = indices.size
    encoding = _cheapest(count, numel, spec)
    if encoding == "dense":
        return spec, None
    if encoding == "sparse":
        head = count * INDEX_BYTES
        payload = alloc(head + values.size)
        payload[:head].view(np.int32)[:] = indices
    else:
        mask = np.zeros(numel, dtype=np.bool_)
        mask[indices] = True
        bitmap = np.packbits(mask, bitorder="little")
        head = bitmap.size
        payload = alloc(head + values.size)
        payload[:head] = bitmap
    payload[head:] = values
    return msgspec.structs.replace(spec, encoding=encoding, count=count), payload


def _cheapest(count: int, numel: int, spec: TensorSpec) -> str:
    """The encoding of a patch changing `count` of a tensor's `numel` elements."""
    return min(_sizes(count, numel, spec).items(), key=lambda item: item[1])[0]


def _sizes(count: int, numel: int, spec: TensorSpec) -> dict[str, float]:
    size = dtype_from_name(spec.dtype).itemsize
    sizes = {
        "sparse": count * (INDEX_BYTES + size) if numel < 1 << 31 else math.inf,
        "bitmap": (numel + 7) // 8 + count * size,
        "dense": dense_nbytes(spec),
    }
    # A bitmap costs a pass over every element on both sides, sparse only over the changes: take
    # it only where it halves the bytes (above ~6% changed for bf16).
    if sizes["bitmap"] > sizes["sparse"] / 2:
        del sizes["bitmap"]
    return sizes


def apply_patch(dest: torch.Tensor, spec: TensorSpec, payload: torch.Tensor) -> None:
    """Write the patch `payload` (its uint8 bytes, as planned by `spec`) into `dest` in place.

    Raises:
        PlanError: the payload names elements outside the tensor, or a bitmap's bits disagree
            with its count (a corrupted or hostile patch; checksums catch corruption first).
    """
    numel, count = math.prod(spec.shape), spec.count
    payload = payload.reshape(-1)
    if payload.numel() != tensor_nbytes(spec):
        raise PlanError(f"patch of {spec.name!r} is {payload.numel()} bytes, its plan says {tensor_nbytes(spec)}")
    if count == 0:
        return
    raw = payload.numpy()
    head = count * INDEX_BYTES if spec.encoding == "sparse" else (numel + 7) // 8
    values = _aligned(raw[head:], _NP_BITS[dtype_from_name(spec.dtype).itemsize])
    where: np.ndarray
    if spec.encoding == "sparse":
        where = _aligned(raw[:head], np.int32)
        if int(where.min()) < 0 or int(where.max()) >= numel:
            raise PlanError(f"patch of {spec.name!r} names elements outside its {numel}")
    else:
        where = np.flatnonzero(np.unpackbits(raw[:head], count=numel, bitorder="little"))
        if where.size != count:
            raise PlanError(f"bitmap patch of {spec.name!r} marks {where.size} elements, its plan says {count}")
    if dest.device.type == "cpu":
        _scatter(element_bits(dest), where, values)
        return
    flat = dest.view(-1).view(BITS[dest.element_size()])
    flat[torch.from_numpy(where.astype(np.int64)).to(dest.device)] = torch.from_numpy(values).to(dest.device)


def _scatter(dest: np.ndarray, where: np.ndarray, values: np.ndarray) -> None:
    """dest[where] = values, natively where built (numpy converts int32 indices to int64 first)."""
    if NATIVE is not None and where.dtype == np.int32 and dest.itemsize in NATIVE_SIZES:
        NATIVE.apply(dest, dest.itemsize, where, values, native_threads())
    else:
        np.put(dest, where, values)


def _aligned(raw: np.ndarray, dtype: type[np.integer[Any]]) -> np.ndarray:
    """Bytes as elements of `dtype`: a view where they are aligned for it, else an aligned copy."""
    aligned = raw.ctypes.data % np.dtype(dtype).itemsize == 0
    return (raw if aligned else raw.copy()).view(dtype)
