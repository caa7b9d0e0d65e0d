"""Megatron-Core trainers: every tensor-, pipeline- and expert-parallel rank pushes what it holds,
in the checkpoint's (Hugging Face) names, with no gather.

    source = MegatronSource(model)        # every rank, in step: one all-gather of metadata
    sender.push(source, version=step)     # every rank: its boxes of the checkpoint tensors

Each parameter of a `GPTModel` is one or more boxes of checkpoint tensors (`source.SourceLayout`),
derived from Megatron's own attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`, the tensor-parallel group of the module that owns it) and the model's config
(query groups, head size); `LAYER` (one transformer layer's names, and the three around the
stack) is the only table:

- `linear_qkv` holds whole query groups, each `[q..., k, v]`: its rows of q_proj, k_proj and
  v_proj, three row boxes cut from one view of it.
- A gated `linear_fc1` (`partition_stride` 2) holds `[gate_r; up_r]`: rows of gate_proj and
  up_proj. Row-parallel layers (`partition_dim` 1: o_proj, down_proj) hold column boxes.
- The vocabulary-parallel embedding and output layer hold rows, the padding beyond the
  checkpoint's vocabulary trimmed off; a tied output layer is not sent (the checkpoint has none).
- Pipeline stages name their layers from 0: the global layer is `layer_number - 1`. Expert j of
  expert-parallel rank r is expert `r * local + j`, split by the expert-tensor-parallel group.
- A tensor several ranks hold alike (norms, the router, a data-parallel replica's shards) is
  sent by one of them, chosen the same way on every rank.

A parameter this cannot name or place (an unknown module, a stride it does not know) is refused
when the source is built, before a byte moves, with one line naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from weightsync.errors import ConfigError
from weightsync.ranks import Exchange
from weightsync.source import Held, SourceLayout, TensorMeta

__all__ = ["LAYER", "MegatronSource"]

LAYER: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "self_attention.linear_qkv.bias": tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.experts.{e}.linear_fc1.weight": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
    "mlp.experts.{e}.linear_fc2.weight": ("mlp.experts.{e}.down_proj.weight",),
    # around the layers: Megatron's name -> the checkpoint's, outside `model.layers.{i}.`
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}
"""Megatron-Core's names of one transformer layer's parameters (local or Transformer Engine
spec; experts as `SequentialMLP` names them, local expert numbers made global as `{e}`) -> the
checkpoint tensors each holds boxes of, in the order it holds them along its split dimension."""

VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")

View = Callable[[torch.Tensor], torch.Tensor]
"""What one checkpoint tensor's box is, as a view (or copy) of the parameter that holds it."""

_EMPTY = torch.empty(0)
"""What `held` yields for a tensor another rank sends (never read)."""


class MegatronSource:
    """A `ShardedSource` over a Megatron-Core `GPTModel`'s parameters, in checkpoint names: each
    rank holds its boxes of them (module docstring). Every rank of `group` builds it at the same
    point (it all-gathers the ranks' boxes once), and every rank pushes it.

    Args:
        model: the rank's `GPTModel`, or its virtual-pipeline chunks; wrappers with `.module`
            (DDP, Float16Module) are looked through. Its parameters are read in place each push.
        vocab_size: the checkpoint's vocabulary (rows beyond it, Megatron's padding, are not
            sent); default: the model's.
        group: the ranks that push (default: every rank); each is one part of every plan.

    Raises:
        ConfigError: a parameter it cannot name or place, naming it.
    """

    def __init__(self, model: Any, *, vocab_size: int | None = None, group: Any = None) -> None:
        import torch.distributed as dist

        chunks = [_unwrap(chunk) for chunk in (model if isinstance(model, Sequence) else [model])]
        vocab = vocab_size if vocab_size is not None else int(chunks[0].vocab_size)
        local: dict[str, tuple[tuple[int, ...], torch.dtype, Held, torch.Tensor, View]] = {}
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
                    continue  # tied: the checkpoint holds the embedding only
                for target, shape, box, view in _boxes(chunk, name, param, vocab):
                    if target in local:
                        raise ConfigError(f"{name}: a second parameter of this rank holds {target!r}")
                    local[target] = (shape, param.dtype, box, param, view)
        self._rank = dist.get_rank(group) if dist.is_initialized() else 0
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        mine = [(name, shape, dtype, box) for name, (shape, dtype, box, _, _) in local.items()]
        everyone: list[Any] = [mine]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine, group=group)
        self._metas, self._layout = _placed(everyone, self._rank, world)
        self._local = {name: (param, view) for name, (_, _, _, param, view) in local.items()}
        self._exchange = Exchange(dist.get_process_group_ranks(group) if group is not None else None)

    def metas(self) -> list[TensorMeta]:
        return list(self._metas)

    def layout(self) -> SourceLayout:
        """Which box of each checkpoint tensor each rank holds (fixed when built)."""
        return self._layout

    def exchange(self, values: list[int], timeout: float) -> list[list[int]]:
        """Every pushing rank's `values` (`source.Exchanges`: a sharded push with delta), over a
        gloo group of `group`'s ranks."""
        return self._exchange(values, timeout)

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every checkpoint tensor's box this rank sends, a view of its parameter (a copy where
        the box is not one: q, k and v of several query groups); nothing of the others."""
        for meta, boxes in zip(self._metas, self._layout.held, strict=True):
            if boxes[self._rank] is None:
                yield meta.name, _EMPTY
            else:
                param, view = self._local[meta.name]
                yield meta.name, view(param.detach())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors whole: those one rank holds (a world of one); refused otherwise (no
        gather: push it from every rank)."""
        if self._layout.world > 1:
            raise ConfigError("a MegatronSource of several ranks is pushed by every rank; it does not gather")
        return self.held()


def _unwrap(module: Any) -> Any:
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


def _boxes(model: Any, name: str, param: torch.Tensor, vocab: int) -> list[tuple[str, tuple[int, ...], Held, View]]:
    """The checkpoint tensors parameter `name` holds boxes of: (name, whole shape, box, view)."""
    key, targets = _targets(model, name)
    split = bool(getattr(param, "tensor_model_parallel", False))
    dim = int(getattr(param, "partition_dim", -1)) if split else 0
    stride = int(getattr(param, "partition_stride", 1)) if split else 1
    owner = model.get_submodule(name.rpartition(".")[0])
    group = getattr(owner, "tp_group", None)
    size, rank = (group.size(), group.rank()) if split and group is not None else (1, 0)
    if split and (group is None or not 0 <= dim < param.dim() or stride not in (1, len(targets))):
        raise ConfigError(f"{name}: split on dim {dim} with stride {stride}, a layout weightsync does not know")
    if "linear_qkv" in key and len(targets) == 3:
        extents, views = _query_groups(model.config, param, size)
    else:
        extent = param.shape[dim] // len(targets)
        extents = [extent] * len(targets)
        views = [_narrow(dim, i * extent, extent) for i in range(len(targets))]
    found = []
    for target, extent, view in zip(targets, extents, views, strict=True):
        shape = list(param.shape)
        shape[dim] = extent * size
        first, stop = rank * extent, (rank + 1) * extent
        if key in VOCAB:
            shape[0], first, stop = vocab, min(first, vocab), min(stop, vocab)
            view = _narrow(0, 0, stop - first)
        box = tuple((0, shape[d]) for d in range(dim)) + ((first, stop),) if size > 1 or key in VOCAB else ()
        found.append((target, tuple(shape), box, view))
    return found


def _targets(model: Any, name: str) -> tuple[str, tuple[str, ...]]:
    """Parameter `name`'s key in `LAYER` and the checkpoint tensors it holds, in global numbers."""
    if name in LAYER:
        return name, LAYER[name]
    found = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if found is not None:
        layer = model.decoder.layers[int(found[1])]
        key, expert = found[2], ""
        local = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.+)", key)
        if local is not None:
            experts = layer.mlp.experts
            number = experts.ep_group.rank() * experts.num_local_experts + int(local[1])
            key, expert = f"mlp.experts.{{e}}.{local[2]}", str(number)
        if key in LAYER:
            prefix = f"model.layers.{layer.layer_number - 1}."
            return key, tuple(prefix + target.format(e=expert) for target in LAYER[key])
    raise ConfigError(f"{name}: a Megatron parameter with no checkpoint name (weightsync knows {sorted(LAYER)})")


def _query_groups(config: Any, param: torch.Tensor, size: int) -> tuple[list[int], list[View]]:
    """The rows of q, k and v this rank's `linear_qkv` holds (whole query groups, each
    `[q..., k, v]`), and how each is cut from it."""
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    head = config.kv_channels
    local_groups, per_group = groups // size, heads // groups
    rest = tuple(param.shape[1:])
    if param.shape[0] != local_groups * (per_group + 2) * head:
        raise ConfigError(f"linear_qkv of {tuple(param.shape)}: not {local_groups} query groups of {per_group} + 2")

    def rows(first: int, count: int) -> View:
        return lambda t: t.view(local_groups, per_group + 2, head, *rest)[:, first : first + count].reshape(-1, *rest)

    views = [rows(0, per_group), rows(per_group, 1), rows(per_group + 1, 1)]
    return [local_groups * per_group * head, local_groups * head, local_groups * head], views


def _narrow(dim: int, first: int, length: int) -> View:
    return lambda t: t.narrow(dim, first, length)


def _placed(everyone: list[Any], rank: int, world: int) -> tuple[list[TensorMeta], SourceLayout]:
    """The checkpoint tensors every rank holds boxes of, in the order the ranks name them, and
    who sends each box: of the ranks holding the same box, the (index mod their number)-th."""
    metas: dict[str, TensorMeta] = {}
    holders: dict[str, dict[Held, list[int]]] = {}
    for holder, entries in enumerate(everyone):
        for name, shape, dtype, box in entries:
            meta = metas.setdefault(name, TensorMeta(name, tuple(shape), dtype))
            if (meta.shape, meta.dtype) != (tuple(shape), dtype):
                raise ConfigError(
                    f"{name}: rank {holder} holds it as {dtype}{list(shape)}, not {meta.dtype}{list(meta.shape)}"
                )
            holders.setdefault(name, {}).setdefault(tuple(box), []).append(holder)
    held = []
    for index, name in enumerate(metas):
        boxes: list[Held | None] = [None] * world
        for box, ranks in holders[name].items():
            boxes[ranks[index % len(ranks)]] = box
        held.append(tuple(boxes))
    return list(metas.values()), SourceLayout(rank, world, tuple(held))
