"""The synthetic model: shapes like a Llama/Qwen decoder in bf16, and content that differs per
tensor, per block and per version, regenerated from the seed to check every byte."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import numpy as np
import torch

from weightsync.pack import byte_view
from weightsync_bench.config import DTYPE

__all__ = ["Shapes", "allocate", "fill", "model_shapes", "verify"]

Shapes = list[tuple[str, tuple[int, ...]]]


def model_shapes(size_bytes: int) -> Shapes:
    """A decoder-only transformer of about `size_bytes` in bf16, shaped like Llama/Qwen models.

    The hidden size grows with the square root of the target so that the two vocabulary matrices
    (64 * hidden rows each) stay about a quarter of the model and larger than a 64 MiB bucket from
    about 1 GiB on; each layer holds mid-size attention and MLP matrices, q/k/v biases and norms.
    """
    hidden = max(64, round(math.sqrt(size_bytes / 1024) / 64) * 64)
    vocab, kv, ffn = 64 * hidden, hidden // 4, 4 * hidden
    layer: Shapes = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.q_proj.bias", (hidden,)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.k_proj.bias", (kv,)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.bias", (kv,)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("post_attention_layernorm.weight", (hidden,)),
        ("mlp.gate_proj.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", (hidden, ffn)),
    ]
    itemsize = DTYPE.itemsize
    layer_bytes = sum(math.prod(shape) for _, shape in layer) * itemsize
    fixed_bytes = (2 * vocab * hidden + hidden) * itemsize
    num_layers = max(1, (size_bytes - fixed_bytes) // layer_bytes)
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for index in range(num_layers):
        shapes += [(f"model.layers.{index}.{name}", shape) for name, shape in layer]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def allocate(shapes: Shapes) -> dict[str, torch.Tensor]:
    """Resident tensors (every page written once), as an engine's loaded weights are."""
    return {name: torch.empty(shape, dtype=DTYPE).fill_(1.0) for name, shape in shapes}


_BLOCK_BYTES = 1 << 20
_GROUP_BYTES = 16 * _BLOCK_BYTES
_MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=4)
def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 64, size=_BLOCK_BYTES // 8, dtype=np.uint64)


def _keys(seed: int, version: int, tensor: int, first_block: int, count: int) -> np.ndarray:
    """One 64-bit key per 1 MiB block: splitmix64 of (seed, version, tensor, block)."""
    base = (((seed * 1_000_003 + version) * 1_000_003 + tensor) << 24) & _MASK
    z = np.arange(first_block, first_block + count, dtype=np.uint64) + np.uint64(base)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _write_pattern(out: np.ndarray, seed: int, version: int, tensor: int, first_block: int) -> None:
    """Write the content of `tensor`'s bytes from block `first_block` on into `out` (uint8):
    each 1 MiB block is the seed's random block XOR that block's key."""
    whole = len(out) // _BLOCK_BYTES
    keys = _keys(seed, version, tensor, first_block, whole + 1)
    if whole:
        rows = out[: whole * _BLOCK_BYTES].view(np.uint64).reshape(whole, -1)
        np.bitwise_xor(_block(seed)[None, :], keys[:whole, None], out=rows)
    rest = len(out) - whole * _BLOCK_BYTES
    if rest:
        out[whole * _BLOCK_BYTES :] = (_block(seed) ^ keys[whole]).view(np.uint8)[:rest]


def _groups(data: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, len(data), _GROUP_BYTES):
        yield start // _BLOCK_BYTES, data[start : start + _GROUP_BYTES]


def fill(tensors: dict[str, torch.Tensor], seed: int, version: int) -> None:
    """Give every tensor the content of `version`, distinct per tensor and per block."""
    for index, tensor in enumerate(tensors.values()):
        for first_block, group in _groups(byte_view(tensor)):
            _write_pattern(group, seed, version, index, first_block)


def verify(tensors: dict[str, torch.Tensor], seed: int, version: int) -> bool:
    """True when every byte of every tensor is what `fill(tensors, seed, version)` writes."""
    scratch = np.empty(_GROUP_BYTES, dtype=np.uint8)
    for index, tensor in enumerate(tensors.values()):
        for first_block, group in _groups(byte_view(tensor)):
            expected = scratch[: len(group)]
            _write_pattern(expected, seed, version, index, first_block)
            if not np.array_equal(group, expected):
                return False
    return True
