"""Where the sender's tensors come from.

A plan needs every tensor's name, shape and dtype before the first byte moves, but a large model
must not be materialised twice. A `WeightSource` therefore answers two questions separately:
`metas()` (cheap metadata) and `tensors()` (the tensors, yielded one at a time, in `metas()` order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch

from weightsync.errors import ConfigError

__all__ = [
    "Exchanges",
    "Held",
    "ShardedSource",
    "SourceLayout",
    "StateDictSource",
    "TensorMeta",
    "WeightSource",
    "as_source",
    "chunk_rows",
    "held_tensors",
    "row_boxes",
    "whole_on",
]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, shape and dtype of a tensor the sender will yield."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@runtime_checkable
class WeightSource(Protocol):
    """Named tensors to send, described before they are produced.

    Implement this to stream tensors that are made on demand (gathered from shards, cast,
    loaded from disk): `metas()` must not materialise them, and `tensors()` may yield each one
    just before it is needed and drop it after.

    A source whose tensors exist for the whole push (a model's own parameters) may say so with
    an attribute `holds_tensors = True`: a transport may then let receivers read them where they
    are (cudaipc shares their GPU memory once and receivers copy straight from it). Generated
    tensors must not: their memory is reused as soon as they are dropped.
    """

    def metas(self) -> list[TensorMeta]:
        """Every tensor's metadata, in the order `tensors()` yields them."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, one at a time, in `metas()` order."""
        ...


Held = tuple[tuple[int, int], ...]
"""A box of a tensor by its leading dimensions: elements [start, stop) along each of the first
`len(held)` dimensions, every later dimension whole; () is the whole tensor."""


@dataclasses.dataclass(frozen=True, slots=True)
class SourceLayout:
    """Which box of each tensor each of the `world` trainer ranks holds, the same on every rank
    but for `rank`. The boxes of one tensor do not overlap and together cover it: a tensor some
    ranks hold alike (a replicated norm) is held, in this layout, by the one that sends it.

    Attributes:
        rank: this sender's rank (the part of every plan it carries).
        world: how many ranks send (the parts of every plan).
        held: per tensor, in source order: per rank, the box it holds (`Held`), or None.
    """

    rank: int
    world: int
    held: tuple[tuple[Held | None, ...], ...]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} of a world of {self.world}")
        for boxes in self.held:
            if len(boxes) != self.world or any(a > b for box in boxes if box for a, b in box):
                raise ConfigError(f"boxes {boxes} do not place a tensor over {self.world} ranks")

    @classmethod
    def whole(cls, num_tensors: int) -> SourceLayout:
        """One sender holding every tensor whole."""
        return cls(0, 1, (((),),) * num_tensors)

    @classmethod
    def from_rows(cls, rank: int, world: int, rows: Iterable[tuple[int, ...] | None]) -> SourceLayout:
        """A layout by rows: per tensor, the row boundaries (`world + 1` of them: rank r holds
        rows [rows[r], rows[r + 1]) of dimension 0), or None where every rank holds it whole and
        rank `index % world` sends it."""
        held = []
        for index, bounds in enumerate(rows):
            if bounds is not None and (len(bounds) != world + 1 or list(bounds) != sorted(bounds)):
                raise ConfigError(f"row boundaries {bounds} do not split a tensor over {world} ranks")
            held.append(row_boxes(bounds) if bounds is not None else whole_on(index % world, world))
        return cls(rank, world, tuple(held))


def row_boxes(bounds: tuple[int, ...]) -> tuple[Held, ...]:
    """Each rank's rows [bounds[r], bounds[r + 1]) of dimension 0, as boxes."""
    return tuple(((low, high),) for low, high in zip(bounds, bounds[1:], strict=False))


def whole_on(owner: int, world: int) -> tuple[Held | None, ...]:
    """Rank `owner` holding a tensor whole, no other rank any of it."""
    return tuple(() if rank == owner else None for rank in range(world))


def chunk_rows(num_rows: int, world: int) -> tuple[int, ...]:
    """The row boundaries of `num_rows` rows chunked over `world` ranks as `torch.chunk` cuts them
    (FSDP2's `Shard(0)`): ceil(rows / world) each, the last ones shorter or empty."""
    size = -(-num_rows // world) if world else 0
    return tuple(min(rank * size, num_rows) for rank in range(world + 1))


@runtime_checkable
class ShardedSource(WeightSource, Protocol):
    """A source whose ranks each push what they hold (sharded sync: every rank has a sender).

    `metas()` describes the whole tensors on every rank, and `tensors()` still yields them whole
    (gathered); a push uses the two below instead, and no rank gathers a tensor it can send in
    part.
    """

    def layout(self) -> SourceLayout | None:
        """Which box of each tensor each rank holds, or None when the source is not sharded (one
        rank pushes it whole). Called once per push, by every rank at the same point: it may
        gather (a collective) what cannot be sent in part."""
        ...

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in `metas()` order as this rank holds it: a tensor of the shape of its box
        in `layout()` (the whole tensor for the box `()`; anything, never read, where it holds
        none). Runs no collective, and may be walked several times per push, from several
        threads at once."""
        ...


@runtime_checkable
class Exchanges(Protocol):
    """A sharded source whose ranks can tell each other a few integers: what a sharded push with
    delta needs (every rank's patch sizes make one plan; their hashes, one content digest)."""

    def exchange(self, values: list[int], timeout: float) -> list[list[int]]:
        """Every rank's `values` (as many on each), in rank order: a collective every rank calls
        at the same point of a push, which raises `CollectiveError` where a rank does not get
        there within `timeout` seconds (`weightsync.ranks.Ranks.exchange`)."""
        ...


class StateDictSource:
    """A source over tensors that already exist (a state dict, `model.named_parameters()`).

    Holds references only: no tensor is copied.
    """

    holds_tensors = True
    """Its tensors exist for the whole push (it holds them)."""

    def __init__(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        seen: set[str] = set()
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ConfigError(f"expected (name, tensor) pairs, got {type(item).__name__}")
            name, tensor = item
            if not isinstance(name, str) or not name:
                raise ConfigError(f"tensor names must be non-empty strings, got {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            if name in seen:
                raise ConfigError(f"tensor name {name!r} appears twice")
            seen.add(name)
        self._items = items

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self._items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._items)


def as_source(
    tensors: WeightSource | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> WeightSource:
    """Accept a WeightSource as is; wrap a mapping or an iterable of (name, tensor) pairs."""
    if isinstance(tensors, WeightSource):
        return tensors
    if isinstance(tensors, (Mapping, Iterable)) and not isinstance(tensors, (str, bytes, torch.Tensor)):
        return StateDictSource(tensors)
    raise ConfigError(f"cannot send a {type(tensors).__name__}: pass a mapping, (name, tensor) pairs or a WeightSource")


def held_tensors(source: WeightSource) -> list[torch.Tensor]:
    """The source's tensors in `metas()` order where it holds them for the whole push
    (`holds_tensors`), else []."""
    if getattr(source, "holds_tensors", False) is not True:
        return []
    return [tensor for _, tensor in source.tensors()]
