"""The weight sink over a transformers model: every chunk lands in place, tied weights included.

A Hugging Face checkpoint names tensors exactly as the model's state dict does, so a name maps to
its live tensor with one dict lookup. Tied weights (`lm_head.weight` and
`model.embed_tokens.weight` sharing storage) are one tensor under several names: a plan may send
any of them, or all of them, but must send at least one name of every group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.sink import WeightSink
from weightsync.types import Plan

__all__ = ["InPlaceModelSink", "alias_groups"]


def alias_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the storage they share (a group of more than one name is a tie)."""
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


class InPlaceModelSink(WeightSink):
    """Writes each sent tensor straight into the model's live tensor of the same name.

    Args:
        tensors: the model's state dict (`model.state_dict(keep_vars=True)`), tied names included.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = {name: tensor.detach() for name, tensor in tensors.items()}
        self._groups = alias_groups(self._tensors)
        self.version: int | None = None

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def begin(self, plan: Plan, version: int) -> None:
        problems = []
        sent = set()
        for spec in plan.tensors:
            target = self._tensors.get(spec.name)
            sent.add(spec.name)
            if target is None:
                problems.append(f"unknown tensor {spec.name!r}")
            elif tuple(target.shape) != spec.shape or target.dtype != dtype_from_name(spec.dtype):
                expected = f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
                problems.append(f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, expected {expected}")
        for group in self._groups:
            if not sent.intersection(group):
                problems.append(f"plan lacks {' / '.join(repr(name) for name in group)}")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise PlanError("plan does not match the model: " + "; ".join(problems[:8]) + more)

    def destination(self, name: str) -> torch.Tensor | None:
        return self._tensors[name]

    def commit(self, version: int) -> None:
        self.version = version
