"""The LoRA adapters an `HFEngine` serves, through PEFT, in memory.

Each pushed version of an adapter becomes one PEFT adapter injected into the model, under a
name never used before (`policy#3`): a request is pinned at admission to the newest committed
version of the adapter it names, and runs every step on that one, whatever is pushed meanwhile.
The newest `keep` versions of each adapter stay resident, and an older one for as long as a
request still runs on it. A re-push under a reused name or version is a new PEFT adapter, so
nothing stale is ever served.

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
        self._served: dict[str, ServedAdapter] = {}
        self.snapshot: tuple[ServedAdapter, ...] = ()
        """Every adapter served, replaced whole on every change (readable from any thread)."""
        self._in_use: dict[str, int] = {}
        """PEFT adapter name -> requests running on it."""
        self._retired: dict[str, str] = {}
        """PEFT adapters no longer resident but still in use, -> their adapter's name."""
        self._layers: list[Any] = []

    def sink(self, adapter: Adapter) -> AdapterSink:
        return AdapterSink(adapter, self.check, self.install)

    def check(self, plan: Plan, adapter: Adapter) -> None:
        check_lora(plan, adapter, self._linears, self.max_rank)

    def install(self, adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make `tensors` version `version` of `adapter`, served to every request admitted from now."""
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

        engine_id = f"{adapter.name}#{next(self._serial)}"
        config = LoraConfig(
            r=adapter.rank,
            lora_alpha=_alpha(adapter.alpha),
            target_modules=list(adapter.target_modules),
            use_rslora=adapter.use_rslora,
        )
        try:
            with warnings.catch_warnings():  # one adapter per version is the point: PEFT warns of a second
                warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
                inject_adapter_in_model(config, self.model, adapter_name=engine_id)
            state = {name.removeprefix("base_model.model."): tensor for name, tensor in tensors.items()}
            loaded = set_peft_model_state_dict(self.model, state, adapter_name=engine_id)
            unplaced = sorted(getattr(loaded, "unexpected_keys", ()))
            if unplaced:
                raise PlanError(f"adapter {adapter.name!r}: PEFT found no place for {unplaced[:5]}")
        except BaseException:  # nothing of a failed install stays in the model
            self._delete(engine_id)
            raise
        self.model.requires_grad_(False)
        self._layers = _tuner_layers(self.model)
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
        for layer in self._layers:
            layer.set_adapter([] if engine_id is None else [engine_id])

    def _retire(self, name: str, engine_id: str) -> None:
        if self._in_use.get(engine_id):
            self._retired[engine_id] = name
        else:
            self._delete(engine_id)

    def _delete(self, engine_id: str) -> None:
        self.activate(None)
        for layer in _tuner_layers(self.model):
            layer.delete_adapter(engine_id)
        getattr(self.model, "peft_config", {}).pop(engine_id, None)
        self._layers = _tuner_layers(self.model)


def _alpha(alpha: float) -> Any:
    """PEFT types lora_alpha as an int and takes a float: an int where it is one."""
    return int(alpha) if alpha.is_integer() else alpha


def _tuner_layers(model: Any) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
