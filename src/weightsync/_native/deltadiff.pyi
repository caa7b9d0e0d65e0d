# The types of the C extension built from deltadiff.c: mypy cannot read a compiled module.
from typing import Any

import numpy as np
from typing_extensions import Buffer

AVX2: int
"""1 when this CPU has AVX2, so the diff compares 32 bytes at a time, else 0."""

def diff(
    new: Buffer | np.ndarray[Any, Any],
    base: Buffer | np.ndarray[Any, Any],
    itemsize: int,
    indices: Buffer | np.ndarray[Any, Any],
    values: Buffer | np.ndarray[Any, Any],
    threads: int,
    /,
) -> int:
    """Compare new with base by bits, copy the changed elements into base; their indices (int32)
    and values go to the first `count` slots of indices and values. Returns count."""

def cast_diff(
    src: Buffer | np.ndarray[Any, Any],
    base: Buffer | np.ndarray[Any, Any],
    indices: Buffer | np.ndarray[Any, Any],
    values: Buffer | np.ndarray[Any, Any],
    threads: int,
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
    /,
) -> None:
    """Write a "blocks" patch into dest; IndexError, with nothing written, if its counts do not
    fit dest or do not add up to the number of offsets."""
