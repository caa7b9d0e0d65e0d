"""Copy routines: bytes of a piece out of a source tensor, and into a destination.

Same-dtype copies between CPU memory go through `numpy.copyto` on uint8 views: single-threaded it
runs at about twice the speed of `torch.Tensor.copy_` on the machines we measured (see
docs/benchmarks.md). Casts and non-CPU tensors go through torch, which converts while copying.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["byte_view", "piece_bytes", "write_piece"]


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= 1:
        # torch calls an empty or one-element tensor contiguous whatever its stride (x[::2][:1]),
        # but view(uint8) refuses a stride other than 1; restate it, same memory.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


def _is_plain(tensor: torch.Tensor, wire_dtype: torch.dtype) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == wire_dtype and tensor.is_contiguous()


def piece_bytes(tensor: torch.Tensor, wire_dtype: torch.dtype, offset: int, nbytes: int) -> np.ndarray | None:
    """The piece's bytes as a view of the source tensor, or None when they must be converted
    (cast, non-contiguous or non-CPU source) with `write_piece`."""
    if not _is_plain(tensor, wire_dtype):
        return None
    return byte_view(tensor)[offset : offset + nbytes]


def write_piece(tensor: torch.Tensor, wire_dtype: torch.dtype, offset: int, nbytes: int, out: np.ndarray) -> None:
    """Write bytes [offset, offset + nbytes) of `tensor` as sent in `wire_dtype` into `out`.

    Args:
        tensor: the source tensor, any device, dtype, layout.
        wire_dtype: the dtype the plan sends it as.
        offset: byte offset into the tensor as sent (in `wire_dtype` units).
        nbytes: bytes to write; `out` must hold exactly that many.
        out: a writable uint8 array (a bucket slice or a destination's bytes).
    """
    view = piece_bytes(tensor, wire_dtype, offset, nbytes)
    if view is not None:
        np.copyto(out, view)
        return
    if nbytes == 0:
        return
    size = wire_dtype.itemsize
    flat = tensor.detach().reshape(-1)  # a copy only when the source is non-contiguous
    source = flat[offset // size : (offset + nbytes) // size]
    torch.from_numpy(out).view(wire_dtype).copy_(source)
