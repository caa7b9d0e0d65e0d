# The types of the C extension built from deltadiff.c: mypy cannot read a compiled module.
from typing import Any

import numpy as np
from typing_extensions import Buffer

AVX2: int
"""1 when this CPU has AVX2, so the diff compares 32 bytes at a time, else 0."""
MAX_THREADS: int
"""The most threads a pass splits over: `crcs` holds this many (CRC32C, bytes after) pairs."""

def diff(
    new: Buffer | np.ndarray[Any, Any],
    base: Buffer | np.ndarray[Any, Any],
    itemsize: int,
    indices: Buffer | np.ndarray[Any, Any],
    values: Buffer | np.ndarray[Any, Any],
    threads: int,
    crcs: np.ndarray[Any, Any] | None = None,
    /,
) -> int:
    """Compare new with base by bits, copy the changed elements into base; their indices (int32)
    and values go to the first `count` slots of indices and values. Returns count. With crcs,
    each thread's (CRC32C of the new bytes of its range, bytes after it) pair goes there."""

def cast_diff(
    src: Buffer | np.ndarray[Any, Any],
    base: Buffer | np.ndarray[Any, Any],
    indices: Buffer | np.ndarray[Any, Any],
    values: Buffer | np.ndarray[Any, Any],
    threads: int,
    crcs: np.ndarray[Any, Any] | None = None,
    /,
) -> int:
    """diff of the float32 src rounded to bf16 as torch rounds it, against the bf16 base."""

def portable(on: bool, /) -> bool:
    """Use the portable loops even where AVX2 is there (tests compare both); the previous setting."""

def apply(
    dest: Buffer | np.ndarray[Any, Any],
    itemsize: int,
    indices: Buffer | np.ndarray[Any, Any],
    values: Buffer | np.ndarray[Any, Any],
    threads: int,
    /,
) -> None:
    """dest[indices[k]] = values[k] (int32 indices, itemsize-byte values); IndexError, with
    nothing written, if any index is outside dest."""

def block_offsets(
    indices: Buffer | np.ndarray[Any, Any],
    counts: Buffer | np.ndarray[Any, Any],
    offsets: Buffer | np.ndarray[Any, Any],
    /,
) -> None:
    """Ascending int32 indices -> each 256-element block's number of them (uint16 counts, one per
    block) and each one's offset in its block (one byte each); IndexError past the last block."""

def apply_blocks(
    dest: Buffer | np.ndarray[Any, Any],
    itemsize: int,
    counts: Buffer | np.ndarray[Any, Any],
    offsets: Buffer | np.ndarray[Any, Any],
    values: Buffer | np.ndarray[Any, Any],
    threads: int,
    crcs: np.ndarray[Any, Any] | None = None,
    /,
) -> None:
    """Write a "blocks" patch into dest (with crcs: and hash dest, as `diff` does); IndexError, with nothing written, if its counts do not
    fit dest or do not add up to the number of offsets."""
