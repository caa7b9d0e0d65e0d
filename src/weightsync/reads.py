"""Which box of each checkpoint tensor an engine's loaders read: a dry run on tensors without
storage, once per engine layout (the slice plan of a sharded sync, docs/architecture.md).

    loader_reads(load, metas)   name -> the box its loader reads, or None where it cannot tell

`load(name, tensor)` is the engine's own loader for one checkpoint tensor; every tensor it is
handed lives on the meta device (a shape, a dtype, no memory), and so should the parameters it
writes (vLLM's layers put back in checkpoint format on the meta device: integrations/vllm/
internals.py). A dispatch mode watches every op the loader runs, and runs none that would write
into memory (a parameter left on the host, such as vLLM's biases): the dry run changes nothing.
A `copy_` whose source is a view
of a handed tensor names what it reads: the view's offset and strides, against the tensor's own
row-major strides, give a box (`narrow`, slicing, `chunk`, `select`, `t()`, a contiguous
`view`). The box a tensor's loader reads is the bounding box of every such copy (a few elements
more, never fewer, where the reads are not one box).

A tensor whose reads cannot be named is None, and a sync sends it whole: a copy from a tensor
computed out of it (`clone`, a cast, `cat`), a strided view that is no box, a loader that kept
the tensor (or a view of it) for later, or a loader that raised on a tensor without storage. A
loader that returns having neither read nor kept it (an expert another expert-parallel rank
holds, a layer of another pipeline stage) reads an empty box: the tensor is not sent at all.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from weightsync.source import TensorMeta

__all__ = ["Box", "loader_reads", "view_box"]

log = logging.getLogger(__name__)

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(start, stop) along each dimension."""


def loader_reads(load: Callable[[str, torch.Tensor], object], metas: Sequence[TensorMeta]) -> dict[str, Box | None]:
    """The box of each tensor of `metas` that `load` reads (module docstring), or None where it
    cannot be named; `load` is called once per tensor, with a meta tensor of its shape and dtype."""
    return {meta.name: _reads_of(load, meta) for meta in metas}


def _reads_of(load: Callable[[str, torch.Tensor], object], meta: TensorMeta) -> Box | None:
    """The box `load` reads of a meta tensor of `meta`'s shape (`loader_reads`)."""
    tensor = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    alive = weakref.ref(tensor)
    watch = _Reads(meta.name, tensor)
    try:
        with torch.no_grad(), watch:
            load(meta.name, tensor)
    except Exception as exc:  # a loader that needs real values: the tensor goes whole
        log.info("%s: its loader cannot run without data (%s: %s); sent whole", meta.name, type(exc).__name__, exc)
        return None
    box = watch.box()
    del watch, tensor
    if alive() is not None:  # the loader holds it, or a view of it, and may read it later
        return None
    return box


def view_box(view: torch.Tensor, shape: Sequence[int]) -> Box | None:
    """The box of a contiguous tensor of `shape` that `view` (a view of it, same dtype) covers,
    or None when its elements are not one box."""
    strides = _row_major(shape)
    start = _unravel(int(view.storage_offset()), strides)
    extents = [1] * len(shape)
    used: set[int] = set()
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size == 1:
            continue
        dim = next((d for d in range(len(shape)) if d not in used and strides[d] == stride and shape[d] > 1), None)
        if dim is None:
            return _flat_box(view, shape, strides)
        used.add(dim)
        extents[dim] = size
    stop = tuple(first + extent for first, extent in zip(start, extents, strict=True))
    if any(end > size for end, size in zip(stop, shape, strict=True)) or math.prod(extents) != view.numel():
        return _flat_box(view, shape, strides)
    return tuple(start), stop


def _flat_box(view: torch.Tensor, shape: Sequence[int], strides: Sequence[int]) -> Box | None:
    """The box of a contiguous view that runs over whole rows of some dimension (a `view` or
    `reshape` of rows), else None."""
    if not view.is_contiguous():
        return None
    offset, count = int(view.storage_offset()), view.numel()
    for dim, block in enumerate(strides):
        if block and offset % block == 0 and count % block == 0:
            first, rows = (offset // block) % shape[dim], count // block
            if first + rows <= shape[dim]:
                start = _unravel(offset, strides)
                stop = [*(a + 1 for a in start[:dim]), first + rows, *shape[dim + 1 :]]
                return tuple(start), tuple(stop)
    return None


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _unravel(offset: int, strides: Sequence[int]) -> list[int]:
    index = []
    for stride in strides:
        index.append(offset // stride)
        offset %= stride
    return index


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an op writes into (its schema's mutable arguments)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written += [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return written


class _Reads(TorchDispatchMode):
    """Watches one loader call on the meta tensor `tensor` (checkpoint tensor `name`): the boxes
    its copies read, and whether anything read it in a way that names no box."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        super().__init__()
        self.name = name
        self.tensor = tensor
        self.boxes: list[Box] = []
        self.opaque = False
        self._derived: list[torch.Tensor] = []
        """Tensors computed out of `tensor` (not views of it): a copy from one names no box."""

    def box(self) -> Box | None:
        """The bounding box of every read, None when some read names no box, an empty box when
        there was no read."""
        if self.opaque:
            return None
        if not self.boxes:
            empty = (0,) * self.tensor.dim()
            return empty, empty
        starts, stops = zip(*self.boxes, strict=True)
        return tuple(map(min, zip(*starts, strict=True))), tuple(map(max, zip(*stops, strict=True)))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self._copied(args[1])
        written = _written(func, args, kwargs)
        if any(tensor.device.type != "meta" for tensor in written):
            return written[0]  # never write into memory: a dry run changes nothing
        out = func(*args, **kwargs)
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if func is not torch.ops.aten.copy_.default and any(self._tracked(tensor) for tensor in inputs):
            self._derived += [
                leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor) and not self._view(leaf)
            ]
        return out

    def _view(self, tensor: torch.Tensor) -> bool:
        return tensor is self.tensor or tensor._base is self.tensor

    def _tracked(self, tensor: torch.Tensor) -> bool:
        return self._view(tensor) or any(tensor is derived or tensor._base is derived for derived in self._derived)

    def _copied(self, source: torch.Tensor) -> None:
        if self._view(source) and source.dtype == self.tensor.dtype:
            if source.numel():
                box = view_box(source, tuple(self.tensor.shape))
                self.opaque = self.opaque or box is None
                self.boxes += [box] if box is not None else []
        elif self._tracked(source):
            self.opaque = True
