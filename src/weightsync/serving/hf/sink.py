"""The weight sink over a transformers model: every chunk lands in place, tied weights included.

A sync carries the model's Hugging Face checkpoint tensors, under the checkpoint's names and
layouts, as the other engines take them. transformers 5 holds some in another layout (a
mixture-of-experts layer stacks its experts into `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj`); each checkpoint tensor (`mlp.experts.0.gate_proj.weight`) is then a view
of its slice of the fused tensor (`weightsync.hf_checkpoint.checkpoint_views`), and lands there in
place. The fused names are not taken: one name per tensor. Tied weights (`lm_head.weight` and
`model.embed_tokens.weight` sharing storage) are one tensor under several names: a plan may send
any of them, or all of them, but must send at least one name of every group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from weightsync.errors import PlanError
from weightsync.messages import Adapter, Plan
from weightsync.sink import SinkTraits, WeightSink, check_against

__all__ = ["InPlaceModelSink", "alias_groups"]


def alias_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the storage they share (a group of more than one name is a tie)."""
    groups: dict[tuple[int, int | torch.SymInt, tuple[int, ...]], list[str]] = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


class InPlaceModelSink(WeightSink):
    """Writes each sent tensor straight into the model's live tensor, or its view, of that name.

    Staged mode keeps a standby copy of every weight: a sync lands there, and `commit` swaps it
    with the live one (the parameters' storage, no copy), so a failed sync never touches what is
    served. It costs one more copy of the weights in memory.

    Args:
        tensors: the model's state dict (`model.state_dict(keep_vars=True)`), tied names included.
        staged: land syncs in a standby copy and swap it in at commit.
        views: the tensors a sync names, cut from model tensors by state dict name
            (`checkpoint_views` bound to the model); by default the model tensors themselves.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        staged: bool = False,
        *,
        views: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = dict,
    ) -> None:
        self._live = dict(tensors)  # the Parameters themselves: a swap replaces their storage
        self._live_groups = alias_groups(self._live)
        self.version: int | None = None
        self.staged = staged
        self.traits = SinkTraits(live_destinations=not staged)
        self._spare: dict[str, torch.Tensor] = {}  # by model name: one per alias group, shared by its names
        if staged:
            for group in self._live_groups:
                self._spare.update(dict.fromkeys(group, torch.empty_like(self._live[group[0]].detach())))
        self._tensors = views({name: tensor.detach() for name, tensor in self._live.items()})
        self._standby = views(self._spare) if staged else {}  # cut as the live ones are
        self._groups = alias_groups(self._tensors)
        self._adapter_sink: Callable[[Adapter], WeightSink] | None = None

    def serve_adapters(self, adapter_sink: Callable[[Adapter], WeightSink]) -> None:
        """Take LoRA adapter syncs too, each in the sink `adapter_sink` gives for it."""
        self._adapter_sink = adapter_sink

    def adapter_sink(self, adapter: Adapter) -> WeightSink:
        if self._adapter_sink is None:
            raise PlanError(
                f"this server serves no LoRA adapters (start it with --max-lora-rank N); adapter {adapter.name!r} refused"
            )
        return self._adapter_sink(adapter)

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def begin(self, plan: Plan, version: int) -> None:
        check_against(plan, self._tensors, strict=False, groups=self._groups)

    def destination(self, name: str) -> torch.Tensor | None:
        return self._standby[name] if self.staged else self._tensors[name]

    def commit(self, version: int) -> None:
        if self.staged:
            for group in self._live_groups:
                standby, previous = self._spare[group[0]], self._live[group[0]].data
                for param in {id(self._live[name]): self._live[name] for name in group}.values():
                    param.data = standby  # tied names are usually one Parameter; views are not
                self._spare.update(dict.fromkeys(group, previous))
            # the views swap with their tensors: the standby's now view the live ones, and back
            self._tensors, self._standby = self._standby, self._tensors
        self.version = version
