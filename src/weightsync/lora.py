"""LoRA adapters as syncs of their own: a trainer pushes only an adapter's tensors, and the
engine serves them, by the adapter's name, on top of the base weights it holds.

    sender   adapter_from_peft(model, name) -> (tensors, Adapter); push(tensors, v, adapter=...)
    wire     an Offer carrying the Adapter; the plan holds PEFT's tensor names
    receiver sink.adapter_sink(adapter) -> an AdapterSink: `begin` checks the adapter against
             the base model (a mismatch is a PlanError, and what is served stays as it was);
             the tensors land in fresh memory; `commit` hands the whole adapter to the engine,
             which serves it as the adapter's newest version from then on

An adapter sync never touches the base weights, so it never leaves them dirty: one that fails
leaves the engine serving exactly what it served before.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, PlanError, SinkError
from weightsync.messages import Adapter, Plan
from weightsync.sink import SinkTraits, WeightSink

__all__ = [
    "Adapter",
    "AdapterSink",
    "AdapterVersion",
    "ServedAdapter",
    "adapter_from_dir",
    "adapter_from_peft",
    "base_from_peft",
    "check_lora",
    "check_name",
    "lora_pairs",
]

_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>[\w.]+)\.lora_(?P<kind>[AB])\.weight")
"""How PEFT names an adapter's tensors (`get_peft_model_state_dict`)."""

_UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (full copies of modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "target_parameters",
}
"""PEFT LoRA settings an adapter push cannot carry, and what to call them in the refusal."""

Install = Callable[[Adapter, int, dict[str, torch.Tensor]], None]
"""An engine taking version `int` of an adapter, whole: from then on it serves that version."""


def adapter_from_peft(model: Any, name: str) -> tuple[dict[str, torch.Tensor], Adapter]:
    """The tensors (PEFT's names) and the `Adapter` of a PEFT model's active LoRA adapter, to
    push as `sender.push(tensors, version, adapter=adapter)`; served as `name`."""
    from peft import get_peft_model_state_dict

    active = model.active_adapter
    config = model.peft_config[active].to_dict()
    tensors = {key: tensor.detach() for key, tensor in get_peft_model_state_dict(model, adapter_name=active).items()}
    return tensors, _adapter(name, config, tensors, repr(active))


def adapter_from_dir(path: str | Path, name: str) -> tuple[dict[str, torch.Tensor], Adapter]:
    """The tensors and the `Adapter` of a LoRA adapter saved by PEFT (`save_pretrained`:
    adapter_config.json and adapter_model.safetensors in `path`), served as `name`."""
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        tensors = load_file(folder / "adapter_model.safetensors")
    except Exception as exc:  # a missing file, bad JSON, a file safetensors cannot read
        raise ConfigError(
            f"{folder} is not a saved PEFT adapter (adapter_config.json, adapter_model.safetensors): {exc}"
        ) from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{folder / 'adapter_config.json'} is not a JSON object")
    return tensors, _adapter(name, config, tensors, str(folder))


def _adapter(name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], what: str) -> Adapter:
    """The Adapter of PEFT LoRA config `config` (as PEFT writes it) over `tensors`."""
    if not name or "/" in name or "@" in name:
        raise ConfigError(f"an adapter's name must be non-empty, without '/' or '@', got {name!r}")
    if str(config.get("peft_type", "")).rsplit(".", 1)[-1] != "LORA":
        raise ConfigError(f"only LoRA adapters can be pushed; {what} is {config.get('peft_type')}")
    used = [what for field, what in _UNSUPPORTED.items() if config.get(field)]
    if config.get("bias", "none") != "none":
        used.append(f"bias={config['bias']!r}")
    if used:
        raise ConfigError(f"adapter {what} uses {', '.join(used)}: only plain LoRA adapters can be pushed")
    modules = {match["module"] for key in tensors if (match := _PEFT_NAME.fullmatch(key))}
    targets = tuple(sorted({module.rsplit(".", 1)[-1] for module in modules}))
    return Adapter(name, int(config["r"]), float(config["lora_alpha"]), targets, bool(config.get("use_rslora")))


def base_from_peft(model: Any) -> dict[str, torch.Tensor]:
    """The base weights under a PEFT LoRA model, in the base model's own names (what a server
    loaded from the base checkpoint holds), without the adapters' tensors."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        tensors[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = tensor.detach()
    return tensors


def lora_pairs(plan: Plan, adapter: Adapter) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every module of an adapter plan, with the shapes of its lora_A and lora_B. PlanError for
    a plan that is not a plain LoRA adapter of `adapter`'s rank and target modules."""
    problems: list[str] = []
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for spec in plan.tensors:
        match = _PEFT_NAME.fullmatch(spec.name)
        if match is None:
            problems.append(f"{spec.name!r} is not a LoRA tensor in PEFT's names (base_model.model.X.lora_A.weight)")
            continue
        module, kind = match["module"], match["kind"]
        if module.rsplit(".", 1)[-1] not in adapter.target_modules:
            problems.append(
                f"{spec.name!r}: module {module!r} is not among target_modules {list(adapter.target_modules)}"
            )
        if len(spec.shape) != 2 or spec.shape[0 if kind == "A" else 1] != adapter.rank:
            problems.append(f"{spec.name!r}: shape {list(spec.shape)} does not have rank {adapter.rank}")
        found.setdefault(module, {})[kind] = spec.shape
    for module, kinds in found.items():
        problems += [f"{module!r} lacks lora_{kind}" for kind in "AB" if kind not in kinds]
    if not found and not problems:
        problems.append("the plan has no tensors")
    _raise_if(problems, f"adapter {adapter.name!r} is not a LoRA adapter this push can carry")
    return {module: (kinds["A"], kinds["B"]) for module, kinds in found.items()}


def check_lora(plan: Plan, adapter: Adapter, linears: Mapping[str, tuple[int, int]], max_rank: int) -> None:
    """Check an adapter plan against a base model's linear layers (module name -> (in_features,
    out_features)) and the engine's largest rank; PlanError naming every mismatch."""
    problems = []
    if not 0 < adapter.rank <= max_rank:
        problems.append(f"rank {adapter.rank} is outside this engine's 1..{max_rank} (--max-lora-rank)")
    for module, (a_shape, b_shape) in lora_pairs(plan, adapter).items():
        shape = linears.get(module)
        if shape is None:
            problems.append(f"the base model has no linear layer {module!r}")
        elif a_shape[1] != shape[0] or b_shape[0] != shape[1]:
            problems.append(
                f"{module!r}: lora_A {list(a_shape)} and lora_B {list(b_shape)} do not fit a layer of "
                f"{shape[0]} inputs and {shape[1]} outputs"
            )
    _raise_if(problems, f"adapter {adapter.name!r} does not fit the served model")


def check_name(adapter: Adapter, model_names: Iterable[str]) -> None:
    """PlanError for an adapter named as the served model: a request naming it would get the
    base weights, never the adapter."""
    if adapter.name in model_names:
        raise PlanError(
            f"adapter {adapter.name!r} has the served model's own name: requests naming it get the base model; "
            "push it under another name"
        )


def _raise_if(problems: list[str], what: str) -> None:
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise PlanError(f"{what}: " + "; ".join(problems[:8]) + more)


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterVersion:
    version: int
    content_digest: str
    """The content digest of its tensors (compare with the push's `SyncReport.content_digest`)."""
    engine_id: str
    """What the engine holds it under (a PEFT adapter name, a vLLM LoRA id): never reused."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServedAdapter:
    """One adapter as served: its config and its resident versions, newest last."""

    adapter: Adapter
    versions: tuple[AdapterVersion, ...]

    @property
    def newest(self) -> AdapterVersion:
        return self.versions[-1]

    def to_json(self) -> dict[str, object]:
        newest = self.newest
        return {
            "name": self.adapter.name,
            "version": newest.version,
            "content_digest": newest.content_digest,
            "rank": self.adapter.rank,
            "alpha": self.adapter.alpha,
            "target_modules": list(self.adapter.target_modules),
            "resident_versions": [v.version for v in self.versions],
        }


class AdapterSink(WeightSink):
    """Lands one adapter sync in fresh tensors and hands the whole adapter to `install` at commit.

    Nothing served changes before the commit (an adapter is small: it costs its own size).

    Args:
        adapter: what the push says the adapter is.
        check: raises PlanError when the plan does not fit the engine (`check_lora`).
        install: the engine taking the adapter's new version, whole.
    """

    traits = SinkTraits(live_destinations=False)

    def __init__(self, adapter: Adapter, check: Callable[[Plan, Adapter], None], install: Install) -> None:
        self.adapter = adapter
        self._check = check
        self._install = install
        self._tensors: dict[str, torch.Tensor] = {}

    def begin(self, plan: Plan, version: int) -> None:
        self._check(plan, self.adapter)
        self._tensors = {spec.name: torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype)) for spec in plan.tensors}

    def destination(self, name: str) -> torch.Tensor | None:
        return self._tensors[name]

    def commit(self, version: int) -> None:
        if not self._tensors:
            raise SinkError(f"commit of adapter {self.adapter.name!r} version {version} without a sync begun")
        tensors, self._tensors = self._tensors, {}
        self._install(self.adapter, version, tensors)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        self._tensors = {}
