"""A pure-torch stand-in for the CPU build of ``sgl_kernel``: test and CPU infrastructure only.

SGLang's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports two bookkeeping helpers from the CPU build
of ``sgl_kernel``, which is built from source for AVX512/AMX and is not published (PyPI's
``sgl-kernel``/``sglang-kernel`` wheels are CUDA-only). ``scripts/install-sglang.sh`` puts this
module on the SGLang venv's path on hosts without a GPU, and only there: on a GPU host the real
``sgl_kernel`` is used. No ``torch.ops.sgl_kernel`` op is registered, so SGLang's AMX check stays
false and every layer takes its pure-torch path.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table.

    Request ``i`` gets ``req_to_token[row_i, start_i:end_i] = out_cache_loc[off:off + n_i]``,
    with ``off`` the sum of the earlier requests' ``n``.
    """
    del pool_len  # the row width; the slices below stay inside it
    offset = 0
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        num_tokens = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + num_tokens].to(req_to_token.dtype)
        offset += num_tokens


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy row ``src_loc[j]`` to row ``tgt_loc[j]`` in every layer buffer (a row is ``stride`` bytes)."""
    targets = tgt_loc.tolist()
    sources = src_loc.tolist()
    for pointer, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for target, source in zip(targets, sources, strict=True):
            if target != source:
                # The buffers are plain host tensors known here only by address.
                ctypes.memmove(pointer + target * stride, pointer + source * stride, stride)


def __getattr__(name: str) -> Any:
    # Every other *_cpu kernel serves speculative decoding or AMX layers, which this CPU path never
    # takes: fail loudly if one is reached.
    if name.endswith("_cpu"):

        def unavailable(*args: Any, **kwargs: Any) -> None:
            raise NotImplementedError(f"sgl_kernel.{name}: not in weightsync's pure-torch CPU stand-in")

        return unavailable
    raise AttributeError(name)
