"""Hugging Face model configs: what weightsync reads from them (today, the bucket that holds a
model's embedding whole). Reads `transformers.PretrainedConfig` objects or plain dicts, so it
imports neither transformers nor a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from weightsync.errors import ConfigError
from weightsync.sizing import align_up

__all__ = ["min_bucket_bytes"]


def _config_get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _config_dtype(config: Any) -> torch.dtype | None:
    for key in ("dtype", "torch_dtype"):
        value = _config_get(config, key)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    return None


def min_bucket_bytes(hf_config: Any, dtype: torch.dtype | str | None = None) -> int:
    """The smallest bucket that holds a model's embedding matrix whole.

    Reads `vocab_size` and `hidden_size` from a transformers config object or a plain dict,
    looking inside a nested `text_config` (vision-language models) when the top level lacks them.

    Args:
        hf_config: a `transformers.PretrainedConfig` or a dict (e.g. a parsed `config.json`).
        dtype: the dtype the weights travel in; defaults to the config's `dtype`/`torch_dtype`,
            then bfloat16.

    Returns:
        `vocab_size * hidden_size * itemsize`, rounded up to the bucket alignment.

    Raises:
        ConfigError: the config names no vocab or hidden size, or the dtype is unknown.
    """
    text_config = _config_get(hf_config, "text_config")
    candidates = [hf_config] + ([text_config] if text_config is not None else [])
    for config in candidates:
        vocab, hidden = _config_get(config, "vocab_size"), _config_get(config, "hidden_size")
        if isinstance(vocab, int) and isinstance(hidden, int) and vocab > 0 and hidden > 0:
            break
    else:
        raise ConfigError(
            "config has no positive integer vocab_size and hidden_size (looked at the top level and at text_config)"
        )
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ConfigError(f"unknown dtype {dtype!r}")
        dtype = cast(torch.dtype, getattr(torch, dtype))
    resolved = dtype or _config_dtype(config) or _config_dtype(hf_config) or torch.bfloat16
    return align_up(vocab * hidden * resolved.itemsize)
