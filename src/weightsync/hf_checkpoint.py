"""A transformers model's weights as its checkpoint holds them: names, shapes and layouts.

transformers 5 keeps some weights in memory in another layout than its checkpoints. A
mixture-of-experts layer holds all its experts in two 3-D tensors (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), where a checkpoint written by `save_pretrained` (and vLLM's
`load_weights`) has one 2-D tensor per expert and projection (`mlp.experts.0.gate_proj.weight`,
...). `save_pretrained` converts back with transformers' own reverse conversion
(`transformers.core_model_loading.revert_weight_conversion`, driven by the model family's
conversion mapping); this module asks the same conversion, so no name rule is written here:

    checkpoint_metas(model, metas)   each model tensor -> the checkpoint tensors it becomes
    HFCheckpointSource(model)        a WeightSource that yields those tensors, for a trainer

Per-expert tensors are yielded as views of the fused tensors (no copy): transformers' reverse of
an expert stack is a `Chunk` (gate from up) then a `SplitModulelist` (one per expert), and its
`Chunk` copies each half of the whole stack (`.contiguous()`) before splitting it. Those two ops
are applied here as views; a tensor whose conversion uses any other op is converted by
transformers itself, which may copy it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from weightsync.errors import ConfigError
from weightsync.module_source import ModuleSource
from weightsync.source import TensorMeta

__all__ = ["HFCheckpointSource", "checkpoint_metas"]


def checkpoint_metas(model: Any, metas: Sequence[TensorMeta]) -> dict[str, list[TensorMeta]]:
    """The checkpoint tensors `save_pretrained` writes for each of `model`'s tensors.

    Args:
        model: a transformers `PreTrainedModel`, on any device or on the meta device.
        metas: the model's tensors (names as `state_dict` gives them, shapes, dtypes).

    Returns:
        model tensor name -> its checkpoint tensors, in order: one for a tensor stored as in
        the checkpoint (perhaps renamed), several for a fused one (a stack of experts).

    Raises:
        ConfigError: the model's conversion joins several of its tensors into one checkpoint
            tensor (e.g. q, k and v saved as one qkv): no tensor of such a model can be sent
            on its own.
    """
    from transformers.core_model_loading import revert_weight_conversion

    shells = {meta.name: torch.empty(meta.shape, dtype=meta.dtype, device="meta") for meta in metas}
    result = {}
    for name, shell in shells.items():
        converted = revert_weight_conversion(model, {name: shell})
        result[name] = [TensorMeta(key, tuple(value.shape), value.dtype) for key, value in converted.items()]
    produced = [(meta.name, meta.shape) for entries in result.values() for meta in entries]
    whole = [(key, tuple(value.shape)) for key, value in revert_weight_conversion(model, shells).items()]
    if sorted(produced) != sorted(whole):
        mismatched = sorted(set(produced) ^ set(whole)) or sorted(p for p in produced if produced.count(p) > 1)
        raise ConfigError(
            f"{type(model).__name__}'s checkpoint joins several of its tensors into one "
            f"({mismatched[0][0]!r}): weightsync converts one tensor at a time"
        )
    return result


class HFCheckpointSource:
    """The weights of a transformers model in its checkpoint's names and layout: what
    `save_pretrained` would write, yielded one tensor at a time, for a trainer to push.

    Fused expert stacks are yielded expert by expert as views (module docstring); every other
    tensor as it is, under its checkpoint name. Tied tensors are yielded once (the first name
    `named_parameters()` gives), FSDP2 parameters are gathered one at a time (`ModuleSource`).

    Args:
        model: a transformers `PreTrainedModel` (transformers 5).

    Raises:
        ConfigError: the model's checkpoint joins several tensors into one (`checkpoint_metas`).
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._module = ModuleSource(model, buffers=True)
        self._checkpoint = checkpoint_metas(model, self._module.metas())
        converters = _reverse_converters(model)
        self._route: dict[str, tuple[str, Any]] = {}
        """model tensor -> how it becomes checkpoint tensors ("as is", "views", "transformers")
        and the reversed converter the views follow."""
        for meta in self._module.metas():
            converter = _converter_of(meta.name, converters)
            route = _route(meta, converter, self._checkpoint[meta.name], model.config)
            self._route[meta.name] = (route, converter)

    def metas(self) -> list[TensorMeta]:
        return [meta for entries in self._checkpoint.values() for meta in entries]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in self._module.tensors():
            route, converter = self._route[name]
            names = [meta.name for meta in self._checkpoint[name]]
            if route == "as is":
                yield names[0], tensor
            elif route == "views":
                yield from zip(names, _split_as_views(tensor, converter, self._model.config) or [], strict=True)
            else:
                yield from revert_weight_conversion(self._model, {name: tensor}).items()


def _reverse_converters(model: Any) -> list[Any]:
    """transformers' weight converters for `model`'s family, reversed (model layout ->
    checkpoint layout), in the order `revert_weight_conversion` tries them (it takes the same
    mapping, or for a model loaded by `from_pretrained` the part of it that loading used)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(model, add_legacy=False)
    return [t.reverse_transform() for t in reversed(transforms) if isinstance(t, WeightConverter)]


def _converter_of(name: str, converters: list[Any]) -> Any:
    """The first reversed converter whose source pattern matches `name`, or None."""
    return next((c for c in converters if c.rename_source_key(name)[1] is not None), None)


def _route(meta: TensorMeta, converter: Any, expected: list[TensorMeta], config: Any) -> str:
    """ "as is" (no converter: at most renamed), "views" (the view ops give the checkpoint's
    shapes) or "transformers" (an op only transformers applies)."""
    if converter is None:
        return "as is"
    shell = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    pieces = _split_as_views(shell, converter, config)
    if pieces is not None and [tuple(p.shape) for p in pieces] == [e.shape for e in expected]:
        return "views"
    return "transformers"


def _split_as_views(tensor: torch.Tensor, converter: Any, config: Any) -> list[torch.Tensor] | None:
    """What a reversed `converter` makes of `tensor`, as views of it: transformers' `Chunk` and
    `SplitModulelist`, in the same order and with the same dims, minus the copy of each chunk;
    None when the converter uses any other op."""
    from transformers.core_model_loading import Chunk, SplitModulelist

    pieces = [tensor]
    for op in converter.operations:
        if type(op) is Chunk:
            count = len(op.get_target_patterns(converter.target_patterns, config=config))
            pieces = [chunk for piece in pieces for chunk in torch.chunk(piece, count, dim=op.dim)]
        elif type(op) is SplitModulelist:
            pieces = [c.squeeze() for piece in pieces for c in torch.chunk(piece, piece.size(op.dim), dim=op.dim)]
        else:
            return None
    return pieces
