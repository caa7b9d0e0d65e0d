"""Page-lock host memory we already own (the shm ring) for the CUDA driver.

A copy between a GPU and ordinary (pageable) host memory goes through the driver's own staging
buffers, one extra host copy at host-memcpy speed. Registered memory is copied by DMA instead.
The shm sender registers its ring when it packs CUDA tensors, and the shm receiver registers its
read-only view of the ring when it lands into CUDA tensors, so a bucket crosses from one GPU to
the other with no CPU copy at all. Where registration fails, copies stay correct and go the slow
way.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

__all__ = ["pin", "pin_all", "readable_tensor", "unpin", "unpin_all"]

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads it (our receivers map the ring read-only)


def pin(region: np.ndarray, *, read_only: bool = False) -> bool:
    """Register `region` with the CUDA driver; False where it cannot be (then copies still work)."""
    if not torch.cuda.is_available() or region.nbytes == 0:
        return False
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(region.ctypes.data, region.nbytes, _PORTABLE | (_READ_ONLY if read_only else 0))
    if int(error) != 0:
        log.info(
            "could not page-lock %d bytes for CUDA copies (cudaError %d): copies go through staging",
            region.nbytes,
            int(error),
        )
        return False
    return True


def unpin(region: np.ndarray) -> None:
    """Undo `pin`; call before the memory is unmapped."""
    torch.cuda.cudart().cudaHostUnregister(region.ctypes.data)


def readable_tensor(data: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over `data`'s memory, also when numpy marks it read-only (a receiver's view of
    the ring): torch has no read-only tensors, so it must only ever be read."""
    if data.flags.writeable:
        return torch.from_numpy(data)
    view = (ctypes.c_uint8 * data.nbytes).from_address(data.ctypes.data)
    return torch.from_numpy(np.ctypeslib.as_array(view))


def pin_all(regions: list[np.ndarray], *, read_only: bool = False) -> bool:
    """Pin every region, or none of them (those pinned are let go again if one fails)."""
    done: list[np.ndarray] = []
    for region in regions:
        if not pin(region, read_only=read_only):
            unpin_all(done)
            return False
        done.append(region)
    return True


def unpin_all(regions: list[np.ndarray]) -> None:
    for region in regions:
        unpin(region)
