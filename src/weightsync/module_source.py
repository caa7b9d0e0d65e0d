"""The trainer's side of a sync: a model's parameters as a lazy `WeightSource`.

A trainer pushes after every optimizer step with one call:

    sender.push(ModuleSource(model, rename=to_hf_names), version=step)

Parameters are yielded one at a time, so a sharded model is never gathered whole: an FSDP2
`DTensor` parameter is gathered with `full_tensor()` just before its bytes are sent and dropped
right after. Tied parameters (one tensor under two names) are sent once, under the first name
`named_parameters()` gives. Cast on send (fp32 master weights sent as bf16) is the sender's
`cast=` option: the bytes are converted while they are packed, with no full-size temporary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from weightsync.errors import ConfigError
from weightsync.source import TensorMeta

__all__ = ["ModuleSource"]

Rename = Callable[[str], str | None] | Mapping[str, str]


class ModuleSource:
    """The parameters (and, with `buffers=True`, the persistent buffers) of `module`.

    Args:
        module: the trainer's model; plain, FSDP2 (`DTensor` parameters) or on any device.
        rename: trainer name -> checkpoint name, as a mapping (names it lacks keep theirs) or a
            callable (returning None leaves the tensor out, e.g. a value head).
        buffers: also send persistent buffers (e.g. rotary caches some checkpoints carry).
    """

    def __init__(self, module: torch.nn.Module, rename: Rename | None = None, *, buffers: bool = False) -> None:
        self._module = module
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
