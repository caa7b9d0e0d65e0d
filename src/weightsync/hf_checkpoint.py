"""A transformers model's weights as its checkpoint holds them: names, shapes and layouts.

transformers 5 keeps some weights in memory in another layout than its checkpoints. A
mixture-of-experts layer holds all its experts in two 3-D tensors (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), where a checkpoint written by `save_pretrained` (and vLLM's
`load_weights`) has one 2-D tensor per expert and projection (`mlp.experts.0.gate_proj.weight`,
...). `save_pretrained` converts back with transformers' own reverse conversion
(`transformers.core_model_loading.revert_weight_conversion`, driven by the model family's
conversion mapping); this module asks the same conversion, so no name rule is written here:

    checkpoint_metas(model, metas)   each model tensor -> the checkpoint tensors it becomes
    checkpoint_views(model, tensors) the model's tensors under checkpoint names, as views of them
    HFCheckpointSource(model)        a WeightSource that yields those tensors, for a trainer

Per-expert tensors are yielded as views of the fused tensors (no copy): transformers' reverse of
an expert stack is a `Chunk` (gate from up) then a `SplitModulelist` (one per expert), and its
`Chunk` copies each half of the whole stack (`.contiguous()`) before splitting it. Those two ops
are applied here as views; a tensor whose conversion uses any other op is converted by
transformers itself, which may copy it.

Sharded (`sharded=True`, an FSDP2 model, every rank pushing): a checkpoint tensor that is a
parameter's rows (renamed at most) is sent by rows as the parameter is held; one that is a view
of a parameter (an expert of a stack) is sent whole by the rank whose rows hold it (FSDP2 splits
a stack by experts); any other is gathered and converted by one rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from weightsync.errors import ConfigError
from weightsync.module_source import ModuleSource, gathered
from weightsync.reads import Box, view_box
from weightsync.source import Held, SourceLayout, TensorMeta, row_boxes, whole_on

__all__ = ["HFCheckpointSource", "checkpoint_metas", "checkpoint_views"]


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


def checkpoint_views(model: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model`'s tensors under the names and shapes its checkpoint holds them in, each a view of
    a model tensor (no copy): where a sync written in checkpoint layout lands in place.

    Args:
        model: a transformers `PreTrainedModel`.
        tensors: model tensors by `state_dict` name (`model.state_dict()`, or tensors of the
            same names and shapes: a standby copy).

    Returns:
        checkpoint name -> view: a tensor stored as in the checkpoint under its checkpoint name,
        a fused one (a stack of experts) cut into one view per checkpoint tensor (module
        docstring); a tensor whose conversion needs an op only transformers applies (no view
        has the checkpoint's layout) under its model name.

    Raises:
        ConfigError: the model's checkpoint joins several tensors into one (`checkpoint_metas`).
    """
    metas = [TensorMeta(name, tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()]
    checkpoint = checkpoint_metas(model, metas)
    views: dict[str, torch.Tensor] = {}
    for name, (route, converter) in _routes(model, metas, checkpoint).items():
        names = [meta.name for meta in checkpoint[name]]
        if route == "as is":
            views[names[0]] = tensors[name]
        elif route == "views":
            views.update(zip(names, _split_as_views(tensors[name], converter, model.config) or [], strict=True))
        else:
            views[name] = tensors[name]
    return views


class HFCheckpointSource:
    """The weights of a transformers model in its checkpoint's names and layout: what
    `save_pretrained` would write, yielded one tensor at a time, for a trainer to push.

    Fused expert stacks are yielded expert by expert as views (module docstring); every other
    tensor as it is, under its checkpoint name. Tied tensors are yielded once (the first name
    `named_parameters()` gives), FSDP2 parameters are gathered one at a time (`ModuleSource`).

    Args:
        model: a transformers `PreTrainedModel` (transformers 5).
        sharded: every rank pushes what it holds (module docstring; `ShardedSource`).

    Raises:
        ConfigError: the model's checkpoint joins several tensors into one (`checkpoint_metas`).
    """

    def __init__(self, model: Any, *, sharded: bool = False) -> None:
        self._model = model
        self.sharded = sharded
        self._module = ModuleSource(model, buffers=True, sharded=sharded)
        self._pieces: dict[str, list[tuple[str, int, Box | None]]] = {}
        """Sharded, this push: each model tensor's checkpoint tensors, each with the rank that
        sends it (-1: every rank holds its rows) and the box of the model tensor it is."""
        self._whole: dict[str, torch.Tensor] = {}
        """Sharded, this push: the model tensors gathered whole, on the rank that converts them."""
        self._checkpoint = checkpoint_metas(model, self._module.metas())
        self._route = _routes(model, self._module.metas(), self._checkpoint)

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

    def layout(self) -> SourceLayout | None:
        """Which rows of each checkpoint tensor each rank holds (module docstring), or None
        unless `sharded`; every rank, in step: it gathers what no rank holds in one piece."""
        module = self._module.layout()
        if module is None:
            return None
        held: list[tuple[Held | None, ...]] = []
        self._pieces, self._whole = {}, {}
        for index, meta in enumerate(self._module.metas()):
            bounds = self._module.rows_of(meta.name)
            pieces = self._place(meta, bounds, index % module.world, module)
            self._pieces[meta.name] = pieces
            for _, owner, _ in pieces:
                held.append(row_boxes(bounds) if owner < 0 and bounds is not None else whole_on(owner, module.world))
        return SourceLayout(module.rank, module.world, tuple(held))

    def exchange(self, values: list[int], timeout: float) -> list[list[int]]:
        """Every rank's `values` (`source.Exchanges`: a sharded push with delta)."""
        return self._module.exchange(values, timeout)

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every checkpoint tensor as this rank holds it (`ShardedSource.held`), in `metas()`
        order; `layout()` ran for this push."""
        rank = self._module.layout_rank
        for name, local in self._module.held():
            pieces = self._pieces[name]
            whole = self._whole.get(name)
            converted = self._converted(name, whole) if whole is not None else {}
            for key, owner, box in pieces:
                if owner < 0:
                    yield key, local
                elif owner != rank:
                    yield key, _EMPTY
                elif box is None:
                    yield key, converted[key] if whole is not None else local
                else:
                    yield key, _box_of(whole if whole is not None else local, box, self._first_row(name, rank))

    def _place(
        self, meta: TensorMeta, bounds: tuple[int, ...] | None, owner: int, module: SourceLayout
    ) -> list[tuple[str, int, Box | None]]:
        """Who sends each checkpoint tensor of model tensor `meta`, and which box of it each is."""
        route, converter = self._route[meta.name]
        names = [entry.name for entry in self._checkpoint[meta.name]]
        if route == "as is":
            return [(names[0], -1 if bounds is not None else owner, None)]
        boxes = _piece_boxes(meta, converter, self._model.config) if route == "views" else None
        owners = [_rows_owner(box, bounds) for box in boxes] if boxes is not None and bounds is not None else []
        if boxes is not None and owners and all(o is not None for o in owners):
            return [(key, o, box) for key, o, box in zip(names, owners, boxes, strict=True) if o is not None]
        if boxes is not None and bounds is None:  # whole on `owner` (plain, or gathered by the module)
            return [(key, owner, box) for key, box in zip(names, boxes, strict=True)]
        whole = gathered(self._module, meta.name)  # every rank, in step
        if module.rank == owner:
            self._whole[meta.name] = whole
        return [(key, owner, None) for key in names]

    def _converted(self, name: str, whole: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self._model, {name: whole}).items())

    def _first_row(self, name: str, rank: int) -> int:
        """The first row of model tensor `name` this rank holds (0 where it holds it whole)."""
        bounds = self._module.rows_of(name)
        return bounds[rank] if bounds is not None and name not in self._whole else 0


_EMPTY = torch.empty(0)
"""What `held` yields for a checkpoint tensor another rank sends (never read)."""


def _piece_boxes(meta: TensorMeta, converter: Any, config: Any) -> list[Box] | None:
    """The box of the model tensor each of its checkpoint tensors is a view of."""
    shell = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    pieces = _split_as_views(shell, converter, config) or []
    boxes = [view_box(piece, meta.shape) for piece in pieces]
    return None if not boxes or any(box is None for box in boxes) else [box for box in boxes if box is not None]


def _rows_owner(box: Box, bounds: tuple[int, ...]) -> int | None:
    """The rank whose rows hold all of `box`'s, or None."""
    (first, *_), (end, *_) = box
    return next((rank for rank in range(len(bounds) - 1) if bounds[rank] <= first and end <= bounds[rank + 1]), None)


def _box_of(tensor: torch.Tensor, box: Box, first_row: int) -> torch.Tensor:
    """`box` of a model tensor (a checkpoint tensor that is a view of it), cut from `tensor`,
    which holds rows from `first_row` on, squeezed as transformers' `SplitModulelist` does."""
    start, stop = box
    view = tensor[
        tuple(
            slice(a - (first_row if d == 0 else 0), b - (first_row if d == 0 else 0))
            for d, (a, b) in enumerate(zip(start, stop, strict=True))
        )
    ]
    return view.squeeze()


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


def _routes(
    model: Any, metas: Sequence[TensorMeta], checkpoint: dict[str, list[TensorMeta]]
) -> dict[str, tuple[str, Any]]:
    """model tensor -> how it becomes its checkpoint tensors (`_route`) and the reversed
    converter the views follow."""
    converters = _reverse_converters(model)
    routes = {}
    for meta in metas:
        converter = _converter_of(meta.name, converters)
        routes[meta.name] = (_route(meta, converter, checkpoint[meta.name], model.config), converter)
    return routes


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
