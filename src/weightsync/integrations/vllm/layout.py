"""What a vLLM worker's model expects a sync to carry: the Hugging Face checkpoint's tensors.

vLLM does not keep weights in checkpoint layout (q/k/v become one `qkv_proj`, gate/up one
`gate_up_proj`, the CPU backend repacks every linear layer), and neither does transformers 5
(a mixture-of-experts layer stacks its experts), but vLLM's `load_weights` takes the
checkpoint's names and layouts (one tensor per expert). A sync is checked against that layout
before any byte moves:

    checkpoint_layout        name -> (shape, dtype) of every tensor, and which names are tied
    check_plan_layout        PlanError naming every way a plan disagrees; else each tensor's feed name
    reprocess_tied_layers    after a reload, re-derive what the CPU backend cached from tied weights
    cpu_experts_to_prepack   before a reload ends: the CPU MoE layers it gave new weights...
    prepack_cpu_experts      ...which vLLM's CPU backend then leaves unpacked (wrong output)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.hf_checkpoint import checkpoint_metas
from weightsync.source import TensorMeta
from weightsync.types import Plan

__all__ = [
    "CheckpointLayout",
    "check_plan_layout",
    "checkpoint_layout",
    "cpu_experts_to_prepack",
    "prepack_cpu_experts",
    "reprocess_tied_layers",
]


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """The tensors a Hugging Face checkpoint of the model holds, in the engine's dtype.

    Attributes:
        tensors: name -> (shape, dtype) of every tensor a sync must carry.
        ties: groups of names that are one tensor (e.g. tied `lm_head.weight` and
            `model.embed_tokens.weight`); the first name of a group is the one vLLM loads.
    """

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ties: tuple[tuple[str, ...], ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of the weights, each tied group counted once."""
        tied = {name for group in self.ties for name in group[1:]}
        return sum(
            _numel(shape) * torch.empty((), dtype=dtype).element_size()
            for name, (shape, dtype) in self.tensors.items()
            if name not in tied
        )


def checkpoint_layout(model_dir: str | Path, dtype: torch.dtype) -> CheckpointLayout:
    """The checkpoint layout of the model in `model_dir`, from config.json alone (a server
    started with `--load-format dummy` may hold no weights): transformers builds the model on
    the meta device (no memory, no init), and its own reverse conversion, the one
    `save_pretrained` applies, names the tensors as a checkpoint does (one tensor per expert
    where the model fuses them; `weightsync.hf_checkpoint`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    state = model.state_dict(keep_vars=True)
    checkpoint = checkpoint_metas(model, [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in state.items()])
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    ties = []
    for names in groups.values():
        for tied in zip(*(checkpoint[name] for name in names), strict=True):
            if len(tied) > 1:
                # vLLM loads a tied pair through the input embeddings and skips lm_head.
                ties.append(tuple(sorted((meta.name for meta in tied), key=lambda n: (n.startswith("lm_head."), n))))
    tensors = {meta.name: (meta.shape, meta.dtype) for entries in checkpoint.values() for meta in entries}
    return CheckpointLayout(tensors, tuple(ties))


def check_plan_layout(plan: Plan, layout: CheckpointLayout) -> dict[str, str | None]:
    """Raise PlanError naming every way `plan` disagrees with `layout`; otherwise return the
    name each planned tensor is fed to vLLM under (None: a tied duplicate, not fed)."""
    problems = []
    for spec in plan.tensors:
        expected = layout.tensors.get(spec.name)
        if expected is None:
            problems.append(f"unknown tensor {spec.name!r}")
            continue
        shape, dtype = expected
        if spec.shape != shape or dtype_from_name(spec.dtype) != dtype:
            wanted = f"{str(dtype).removeprefix('torch.')}{list(shape)}"
            problems.append(f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, expected {wanted}")
    sent = {spec.name for spec in plan.tensors}
    if len(sent) != len(plan.tensors):
        problems.append("plan names a tensor twice")
    feed: dict[str, str | None] = {name: name for name in sent}
    tied: set[str] = set()
    for group in layout.ties:
        tied.update(group)
        present = [name for name in group if name in sent]
        if not present:
            problems.append(f"plan lacks {' / '.join(repr(name) for name in group)}")
            continue
        for name in present:
            feed[name] = None
        feed[present[0]] = group[0]
    missing = sorted(set(layout.tensors) - sent - tied)
    problems += [f"plan lacks {name!r}" for name in missing]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise PlanError("plan does not match the model's checkpoint layout: " + "; ".join(problems[:8]) + more)
    return feed


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def reprocess_tied_layers(model: torch.nn.Module) -> None:
    """Re-run weight post-processing on layers that share their weight with another layer.

    The layerwise reload loads a tied pair once (through the input embeddings) and leaves the
    other layer (lm_head) as it was; on CPU that layer holds a repacked copy of the old weight
    for its matmul, so it must be processed again from the new values.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)


def cpu_experts_to_prepack(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """The MoE layers on vLLM's CPU expert kernels that the current layerwise reload gave new
    weights, each with its kernel's experts; call it before `finalize_layerwise_reload`.

    A layer counts when vLLM processed it during loading or will process it at the end (some
    of its elements loaded); a layer that got nothing keeps its (packed) weights.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    found = []
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            info = get_layerwise_info(module)
            if not info.can_load() or info.load_numel > 0:
                found.append((module, experts))
    return found


def prepack_cpu_experts(layers: list[tuple[torch.nn.Module, Any]]) -> None:
    """Pack the new expert weights of `layers` (from `cpu_experts_to_prepack`) into the CPU
    kernel's grouped-gemm layout, after the reload ended.

    vLLM 0.32 packs them there on the first load only: on a reload its unquantized MoE method
    copies the new weights in and skips the experts' own post-processing, which is where the CPU
    experts pack them, so the CPU kernel would compute with unpacked weights, silently. Should vLLM pack them itself one day, they would be packed
    twice and the vLLM backend's greedy-output test fails.
    """
    for module, experts in layers:
        experts.process_weights_after_loading(module)
