"""The LoRA adapters an `HFEngine` serves, through PEFT, in memory.

Each pushed version of an adapter is held in a PEFT adapter slot of the model, under an id
never used before (`policy#3`): a request is pinned at admission to the newest committed version
of the adapter it names, and runs every step on that one, whatever is pushed meanwhile. The
newest `keep` versions of each adapter stay resident, and an older one for as long as a request
still runs on it. A re-push under a reused name or version gets a new id, so nothing stale is
ever served.

A slot is injected once (`inject_adapter_in_model`: a LoRA layer in every targeted module) and
reused: once no request runs on a version, its slot is free, and the next version of the same
shape (rank, alpha, modules) is copied into it, as vLLM copies adapters into its preallocated
slots. Injecting costs milliseconds per module; the copy costs the adapter's bytes.

Only the engine's own thread calls `install`, `pin`, `activate` and `release` (a rollout server
parks its engine loop around `install`); `snapshot` may be read from any thread.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch

from weightsync.digest import source_digest
from weightsync.errors import PlanError, RequestError
from weightsync.lora import Adapter, AdapterSink, AdapterVersion, ServedAdapter, check_lora
from weightsync.messages import Plan

__all__ = ["LoraServing"]


class LoraServing:
    """The adapters served on one transformers model.

    Args:
        model: the served model (adapters are injected into its linear layers).
        keep: versions of each adapter kept resident (at least 1).
        max_rank: the largest adapter rank accepted.
    """

    def __init__(self, model: Any, *, keep: int = 2, max_rank: int = 64) -> None:
        if keep < 1 or max_rank < 1:
            raise ValueError(f"keep and max_rank must be at least 1, got {keep} and {max_rank}")
        self.model = model
        self.keep = keep
        self.max_rank = max_rank
        self._linears = {
            name: (module.in_features, module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }
        self._serial = itertools.count(1)
        self._slot_serial = itertools.count(1)
        self._served: dict[str, ServedAdapter] = {}
        self.snapshot: tuple[ServedAdapter, ...] = ()
        """Every adapter served, replaced whole on every change (readable from any thread)."""
        self._in_use: dict[str, int] = {}
        """PEFT adapter name -> requests running on it."""
        self._retired: dict[str, str] = {}
        """PEFT adapters no longer resident but still in use, -> their adapter's name."""
        self._layers: list[Any] = []
        self._slots: dict[str, tuple[str, _Shape]] = {}
        """Engine id -> the PEFT adapter (slot) holding it, and the slot's shape."""
        self._free: dict[_Shape, list[str]] = {}
        """Slots no version is held in, by shape: the next version of that shape is copied in."""

    def sink(self, adapter: Adapter) -> AdapterSink:
        return AdapterSink(adapter, self.check, self.install)

    def check(self, plan: Plan, adapter: Adapter) -> None:
        check_lora(plan, adapter, self._linears, self.max_rank)

    def install(self, adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make `tensors` version `version` of `adapter`, served to every request admitted from now."""
        engine_id = f"{adapter.name}#{next(self._serial)}"
        state = {name.removeprefix("base_model.model."): tensor for name, tensor in tensors.items()}
        shape = (adapter.rank, adapter.alpha, adapter.use_rslora, frozenset(state))
        free = self._free.get(shape)
        if free:
            slot = free.pop()
            with torch.no_grad():  # every tensor of the slot: the shape names them all
                for name, tensor in state.items():
                    _slot_weight(self.model, name, slot).copy_(tensor)
        else:
            slot = self._inject(adapter, f"weightsync-slot-{next(self._slot_serial)}", state)
        self._slots[engine_id] = (slot, shape)
        self.activate(None)
        served = self._served.get(adapter.name)
        fresh = AdapterVersion(version, source_digest(tensors), engine_id)
        versions = (*served.versions, fresh) if served is not None and served.adapter == adapter else (fresh,)
        dropped = [v for v in served.versions if v not in versions] if served is not None else []
        dropped += list(versions[: -self.keep])
        self._served[adapter.name] = ServedAdapter(adapter, versions[-self.keep :])
        self.snapshot = tuple(self._served.values())
        for old in dropped:
            self._retire(adapter.name, old.engine_id)

    def _inject(self, adapter: Adapter, slot: str, state: dict[str, torch.Tensor]) -> str:
        """A new PEFT adapter `slot` shaped like `adapter`, holding `state`."""
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

        config = LoraConfig(
            r=adapter.rank,
            lora_alpha=_alpha(adapter.alpha),
            target_modules=list(adapter.target_modules),
            use_rslora=adapter.use_rslora,
        )
        try:
            with warnings.catch_warnings():  # one adapter per slot is the point: PEFT warns of a second
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                inject_adapter_in_model(config, self.model, adapter_name=slot)
            loaded = set_peft_model_state_dict(self.model, state, adapter_name=slot)
            unplaced = sorted(getattr(loaded, "unexpected_keys", ()))
            if unplaced:
                raise PlanError(f"adapter {adapter.name!r}: PEFT found no place for {unplaced[:5]}")
        except BaseException:  # nothing of a failed install stays in the model
            self._delete_slot(slot)
            raise
        self.model.requires_grad_(False)
        self._layers = _tuner_layers(self.model)
        return slot

    def pin(self, name: str) -> AdapterVersion:
        """The newest version of adapter `name`, held resident until `release`."""
        served = self._served.get(name)
        if served is None:
            raise RequestError(f"no adapter {name!r} is served here")
        newest = served.newest
        self._in_use[newest.engine_id] = self._in_use.get(newest.engine_id, 0) + 1
        return newest

    def release(self, engine_id: str) -> None:
        left = self._in_use.get(engine_id, 0) - 1
        if left > 0:
            self._in_use[engine_id] = left
            return
        self._in_use.pop(engine_id, None)
        if engine_id in self._retired:
            self._retire(self._retired.pop(engine_id), engine_id)

    def activate(self, engine_id: str | None) -> None:
        """Run the next forward with this adapter (None: the base weights alone)."""
        active = [] if engine_id is None else [self._slots[engine_id][0]]
        for layer in self._layers:
            layer.set_adapter(active)

    def _retire(self, name: str, engine_id: str) -> None:
        if self._in_use.get(engine_id):
            self._retired[engine_id] = name
        else:  # no request runs on it: its slot takes the next version of its shape
            slot, shape = self._slots.pop(engine_id)
            self._free.setdefault(shape, []).append(slot)

    def _delete_slot(self, slot: str) -> None:
        for layer in _tuner_layers(self.model):
            layer.delete_adapter(slot)
        getattr(self.model, "peft_config", {}).pop(slot, None)
        self._layers = _tuner_layers(self.model)


_Shape = tuple[int, float, bool, frozenset[str]]
"""What makes a slot fit a version: rank, alpha, rsLoRA, and the names of its tensors."""


def _slot_weight(model: Any, name: str, slot: str) -> torch.Tensor:
    """The tensor of PEFT adapter `slot` that `name` ("<module>.lora_A.weight") names."""
    module, kind, _ = name.rsplit(".", 2)
    weight: torch.Tensor = getattr(model.get_submodule(module), kind)[slot].weight
    return weight


def _alpha(alpha: float) -> Any:
    """PEFT types lora_alpha as an int and takes a float: an int where it is one."""
    return int(alpha) if alpha.is_integer() else alpha


def _tuner_layers(model: Any) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
