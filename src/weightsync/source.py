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

__all__ = ["StateDictSource", "TensorMeta", "WeightSource", "as_source", "held_tensors"]


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
