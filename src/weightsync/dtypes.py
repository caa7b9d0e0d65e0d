"""Names for torch dtypes on the wire, and their sizes.

The wire carries dtypes as strings ("bfloat16"), never as pickled objects. Only dtypes with a
whole-byte element size are supported: every chunk boundary then falls on an element boundary.
"""

from __future__ import annotations

import torch

from weightsync.errors import ConfigError, PlanError

__all__ = ["dtype_from_name", "dtype_name"]

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`; raises ConfigError for dtypes weightsync cannot send."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype} is not supported; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; raises PlanError for names a peer should not send."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise PlanError(f"unknown dtype {name!r} in plan; supported: {sorted(_DTYPES)}") from None
