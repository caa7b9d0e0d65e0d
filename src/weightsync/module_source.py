"""The trainer's side of a sync: a model's parameters as a lazy `WeightSource`.

A trainer pushes after every optimizer step with one call:

    sender.push(ModuleSource(model, rename=to_hf_names), version=step)

Parameters are yielded one at a time, so a sharded model is never gathered whole: an FSDP2
`DTensor` parameter is gathered with `full_tensor()` just before its bytes are sent and dropped
right after. Tied parameters (one tensor under two names) are sent once, under the first name
`named_parameters()` gives. Cast on send (fp32 master weights sent as bf16) is the sender's
`cast=` option: the bytes are converted while they are packed, with no full-size temporary.

With `sharded=True`, every rank pushes (sharded sync, docs/architecture.md): each sends the
rows it holds of every FSDP2 parameter (`DTensor` with `Shard(0)` on a 1-D mesh), read in place
(`to_local()`), and no rank gathers them; a tensor every rank holds whole (a plain parameter) is
sent by one rank (its index mod the world size); a `DTensor` placed any other way is gathered
once per push by every rank (`layout()`) and sent by its owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from weightsync.errors import ConfigError
from weightsync.ranks import Exchange
from weightsync.source import SourceLayout, TensorMeta, chunk_rows

__all__ = ["ModuleSource"]

log = logging.getLogger(__name__)

Rename = Callable[[str], str | None] | Mapping[str, str]


class ModuleSource:
    """The parameters (and, with `buffers=True`, the persistent buffers) of `module`.

    Args:
        module: the trainer's model; plain, FSDP2 (`DTensor` parameters) or on any device.
        rename: trainer name -> checkpoint name, as a mapping (names it lacks keep theirs) or a
            callable (returning None leaves the tensor out, e.g. a value head).
        buffers: also send persistent buffers (e.g. rotary caches some checkpoints carry).
        sharded: every rank pushes the rows it holds (module docstring); False: one rank pushes
            whole tensors (gathered one by one).
    """

    def __init__(
        self, module: torch.nn.Module, rename: Rename | None = None, *, buffers: bool = False, sharded: bool = False
    ) -> None:
        self._module = module
        self.sharded = sharded
        self._gathered: dict[int, torch.Tensor] = {}
        """This push's tensors `layout()` gathered that this rank sends."""
        self._layout: SourceLayout | None = None
        """This push's layout (`layout()`)."""
        self._exchange: Exchange | None = None
        self._rows: dict[str, tuple[int, ...] | None] = {}
        """This push's row boundaries of each tensor (`layout()`; None: held whole)."""
        named: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        if buffers:
            persistent = {name for name, _ in module.named_buffers() if _is_persistent(module, name)}
            named += [(name, t) for name, t in module.named_buffers() if name in persistent]
        self._entries: list[tuple[str, torch.Tensor]] = []
        seen_storage: set[int] = set()
        seen_names: dict[str, str] = {}
        for name, tensor in named:
            key = id(tensor)
            if key in seen_storage:
                continue  # tied: the same Parameter under another name
            seen_storage.add(key)
            target = _rename(rename, name)
            if target is None:
                continue
            if target in seen_names:
                raise ConfigError(f"rename maps both {seen_names[target]!r} and {name!r} to {target!r}")
            seen_names[target] = name
            self._entries.append((target, tensor))
        self.holds_tensors = not any(hasattr(tensor, "full_tensor") for _, tensor in self._entries)
        """Whether its tensors exist for the whole push: not when a shard is gathered per push."""

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(tensor.shape), tensor.dtype) for name, tensor in self._entries]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._entries:
            yield name, _full(tensor)

    def layout(self) -> SourceLayout | None:
        """Which rows of each tensor each rank holds (None unless `sharded`); gathers, on every
        rank, the `DTensor`s placed other than `Shard(0)` on a 1-D mesh, keeping those it sends."""
        if not self.sharded:
            return None
        rank, world = _rank_and_world([tensor for _, tensor in self._entries])
        rows: list[tuple[int, ...] | None] = []
        self._gathered = {}
        for index, (name, tensor) in enumerate(self._entries):
            bounds = _row_bounds(tensor, rank, world)
            if bounds is None and hasattr(tensor, "full_tensor"):
                log.info("%s: placed %s, gathered to be sent whole", name, getattr(tensor, "placements", "?"))
                full = _full(tensor)
                if index % world == rank:
                    self._gathered[index] = full
            rows.append(bounds)
        self._rows = dict(zip((name for name, _ in self._entries), rows, strict=True))
        self._layout = SourceLayout.from_rows(rank, world, rows)
        return self._layout

    def exchange(self, values: list[int], timeout: float) -> list[list[int]]:
        """Every rank's `values` (`source.Exchanges`: a sharded push with delta): the ranks of
        the parameters' mesh (`layout`'s), else every rank."""
        if self._exchange is None:
            self._exchange = Exchange(_mesh_ranks([tensor for _, tensor in self._entries]))
        return self._exchange(values, timeout)

    @property
    def layout_rank(self) -> int:
        """This rank in this push's layout (0 before `layout()`)."""
        return self._layout.rank if self._layout is not None else 0

    def rows_of(self, name: str) -> tuple[int, ...] | None:
        """The row boundaries of tensor `name` in this push's layout (None: whole)."""
        return self._rows.get(name)

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as this rank holds it (`ShardedSource.held`): its local rows of a sharded
        parameter, read in place; a plain one whole; what `layout()` gathered for it to send."""
        for index, (name, tensor) in enumerate(self._entries):
            gathered = self._gathered.get(index)
            if gathered is not None:
                yield name, gathered
            elif hasattr(tensor, "to_local"):
                yield name, tensor.to_local().detach() if _row_split(tensor) else _EMPTY
            else:
                yield name, tensor.detach()


_EMPTY = torch.empty(0)
"""What `held` yields for a gathered tensor another rank sends (never read)."""


def gathered(source: ModuleSource, name: str) -> torch.Tensor:
    """Tensor `name` of `source` whole: gathered (a collective: every rank calls it, in step)."""
    return _full(dict(source._entries)[name])


def _rank_and_world(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """This rank and the number of ranks: the 1-D mesh of the sharded parameters, else the
    default process group (every rank holding every tensor whole), else one rank."""
    for tensor in tensors:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and mesh.ndim == 1:
            return int(mesh.get_local_rank()), int(mesh.size())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mesh_ranks(tensors: list[torch.Tensor]) -> list[int] | None:
    """The global ranks of the 1-D mesh of the sharded parameters (`_rank_and_world`'s), or None."""
    for tensor in tensors:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and mesh.ndim == 1:
            return [int(rank) for rank in mesh.mesh.flatten().tolist()]
    return None


def _row_split(tensor: Any) -> bool:
    """Whether a `DTensor` is split by rows (`Shard(0)`) over a 1-D mesh."""
    from torch.distributed.tensor import Shard

    placements = tuple(getattr(tensor, "placements", ()))
    return tensor.device_mesh.ndim == 1 and placements == (Shard(0),) and tensor.dim() > 0


def _row_bounds(tensor: Any, rank: int, world: int) -> tuple[int, ...] | None:
    """Where a tensor's rows are split over the ranks (`torch.chunk`'s cut, checked against the
    rows this rank holds), or None for a tensor every rank holds whole or one to gather."""
    if not hasattr(tensor, "to_local") or not _row_split(tensor) or tensor.device_mesh.size() != world:
        return None
    bounds = chunk_rows(int(tensor.shape[0]), world)
    local = tensor.to_local()
    if local.shape[0] != bounds[rank + 1] - bounds[rank] or tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
        return None
    return bounds


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: gathered if it is a DTensor shard, detached either way."""
    full_tensor = getattr(tensor, "full_tensor", None)  # torch.distributed.tensor.DTensor
    if full_tensor is not None:
        return full_tensor().detach()
    return tensor.detach()


def _rename(rename: Rename | None, name: str) -> str | None:
    if rename is None:
        return name
    if isinstance(rename, Mapping):
        return rename.get(name, name)
    target = rename(name)
    if target is not None and (not isinstance(target, str) or not target):
        raise ConfigError(f"rename({name!r}) returned {target!r}; expected a non-empty name or None")
    return target


def _is_persistent(module: torch.nn.Module, name: str) -> bool:
    owner_name, _, buffer_name = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return buffer_name not in owner._non_persistent_buffers_set
