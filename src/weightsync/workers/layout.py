"""What an engine worker's model expects a sync to carry: the Hugging Face checkpoint's tensors.

Engines do not keep weights in checkpoint layout (vLLM and SGLang fuse q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj`, vLLM's CPU backend repacks every linear layer),
and neither does transformers 5 (a mixture-of-experts layer stacks its experts), but an
engine's `load_weights` takes the checkpoint's names and layouts (one tensor per expert). A sync
is checked against that layout before any byte moves:

    checkpoint_layout        name -> (shape, dtype) of every tensor, and which names are tied
    check_plan_layout        PlanError naming every way a plan disagrees; else each tensor's feed name
    kept_boxes               the box of each tensor this worker's loaders keep (sharded sync)

A tensor-parallel worker keeps a box of most tensors (rows of q/k/v, gate/up and the
embeddings, columns of o and down, a slice of every expert, the whole of a replicated one).
`kept_boxes` finds them by running the engine's own loader once on tensors without storage
(`weightsync.reads`; the engine puts its layers in checkpoint format on the meta device first);
the trainer is then sent only those boxes, and the worker hands each to the loader inside a
tensor of the checkpoint's shape (`padded`), whose elements outside the box the loader never
reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import PlanError
from weightsync.hf_checkpoint import checkpoint_metas
from weightsync.messages import Plan, TensorSpec, Want
from weightsync.reads import loader_reads
from weightsync.regions import region_view, whole_shape
from weightsync.sink import mismatch
from weightsync.source import TensorMeta

__all__ = ["CheckpointLayout", "check_plan_layout", "checkpoint_layout", "check_boxes", "kept_boxes", "padded"]


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """The tensors a Hugging Face checkpoint of the model holds, in the engine's dtype.

    Attributes:
        tensors: name -> (shape, dtype) of every tensor a sync must carry.
        ties: groups of names that are one tensor (e.g. tied `lm_head.weight` and
            `model.embed_tokens.weight`); the first name of a group is the one the engine loads.
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
                # An engine loads a tied pair through the input embeddings and skips lm_head.
                ties.append(tuple(sorted((meta.name for meta in tied), key=lambda n: (n.startswith("lm_head."), n))))
    tensors = {meta.name: (meta.shape, meta.dtype) for entries in checkpoint.values() for meta in entries}
    return CheckpointLayout(tensors, tuple(ties))


def check_plan_layout(plan: Plan, layout: CheckpointLayout) -> dict[str, str | None]:
    """Raise PlanError naming every way `plan` disagrees with `layout`; otherwise return the
    name each planned tensor is fed to the engine's loader under (None: a tied duplicate, not fed)."""
    problems = []
    kinds: set[tuple[str, str] | None] = set()
    for spec in plan.tensors:
        expected = layout.tensors.get(spec.name)
        if expected is None:
            problems.append(f"unknown tensor {spec.name!r}")
            kinds.add(None)
            continue
        shape, dtype = expected
        whole = whole_shape(spec)
        if whole != shape or dtype_from_name(spec.dtype) != dtype:
            held = str(dtype).removeprefix("torch.")
            problems.append(f"{spec.name!r}: sent {spec.dtype}{list(whole)}, expected {held}{list(shape)}")
            kinds.add((spec.dtype, held) if whole == shape else None)
    sent = {spec.name for spec in plan.tensors}
    if len(sent) != len(plan.tensors):
        problems.append("plan names a tensor twice")
        kinds.add(None)
    feed: dict[str, str | None] = {name: name for name in sent}
    tied: set[str] = set()
    for group in layout.ties:
        tied.update(group)
        present = [name for name in group if name in sent]
        if not present:
            problems.append(f"plan lacks {' / '.join(repr(name) for name in group)}")
            kinds.add(None)
            continue
        for name in present:
            feed[name] = None
        feed[present[0]] = group[0]
    missing = sorted(set(layout.tensors) - sent - tied)
    problems += [f"plan lacks {name!r}" for name in missing]
    kinds.update([None] if missing else [])
    if problems:
        raise mismatch(problems, kinds, "the model's checkpoint layout")
    return feed


def kept_boxes(load: Callable[[str, torch.Tensor], object], layout: CheckpointLayout) -> tuple[Want, ...]:
    """The box of each checkpoint tensor that this worker's loaders keep (the module docstring),
    named under every name of a tied group; a tensor they cannot be traced for is not named (a
    sync sends it whole). `load(name, tensor)` runs the engine's loader on one tensor, its layers
    in checkpoint format on the meta device (vLLM: `internals.checkpoint_format_on_meta`)."""
    aliases = {group[0]: group for group in layout.ties}
    skipped = {name for group in layout.ties for name in group[1:]}
    metas = [TensorMeta(name, shape, dtype) for name, (shape, dtype) in layout.tensors.items() if name not in skipped]
    reads = loader_reads(load, metas)
    return tuple(
        Want(alias, *box) for name, box in reads.items() if box is not None for alias in aliases.get(name, (name,))
    )


def check_boxes(plan: Plan, kept: tuple[Want, ...]) -> None:
    """Raise PlanError when a box `plan` carries is not the one this worker keeps of its tensor."""
    boxes = {want.name: (want.start, want.stop) for want in kept}
    for spec in plan.tensors:
        if spec.region is None:
            continue  # sent whole: the loader cuts what it keeps
        start = spec.region.start
        stop = tuple(first + extent for first, extent in zip(start, spec.shape, strict=True))
        if boxes.get(spec.name) != (start, stop):
            raise PlanError(f"{spec.name!r}: sent the box {start}..{stop}, this worker keeps {boxes.get(spec.name)}")


def padded(spec: TensorSpec, box: torch.Tensor) -> torch.Tensor:
    """`box` (what a sync carried of `spec`'s tensor) inside a tensor of the whole tensor's shape,
    whose other elements are left unset: the worker's loader reads only the box (`kept_boxes`)."""
    if spec.region is None:
        return box
    whole = torch.empty(spec.region.whole, dtype=box.dtype)
    region_view(whole, spec).copy_(box)
    return whole


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
