"""The one place weightsync reaches into vLLM's internals.

- The weight version of streamed tokens (`token_version`, below).
- During a layerwise reload, the tensors vLLM keeps for layers not yet complete
  (`ReloadBuffers`): a worker hands vLLM views into the transport's buffer, which the
  receiver reuses for the next bucket.
- After a layerwise reload, what vLLM 0.32's CPU backend leaves stale: a tied layer's repacked
  copy (`reprocess_tied_layers`) and reloaded MoE experts left unpacked
  (`cpu_experts_to_prepack`, `prepack_cpu_experts`).
- LoRA adapters held in memory (`LoraMemory`, `serve_loras_from_memory`, `serve_lora`): vLLM
  loads an adapter only from a path, and drops every adapter after a base-weight update.
- The model's layers in checkpoint format on the meta device, for a dry run of its loaders
  (`checkpoint_format_on_meta`): what a sharded sync's worker keeps of each tensor.
- The module behind the trainer's `vllm...base.ModuleSource` (`module_of`), so that weightsync
  reads it in place (and shards it) rather than through vLLM's gathering iteration.

vLLM labels every batch of outputs with the engine's weight version and records, per request,
where each version's tokens start (`RequestState.weight_version_starts` in
`vllm/v1/engine/output_processor.py`). Its public API hands the spans out only on a request's
final output (`CompletionOutput.weight_versions`), and its OpenAI responses not at all. A
streamed chunk needs the version of its newest token before the request ends, which only that
per-request record holds. Everything else weightsync does with vLLM goes through public entry
points (build_app, init_app_state, AsyncLLM, the weight-transfer registries and lifecycle).

`tests/vllm_serve/test_internals_guard.py` fails loudly when an upgrade moves any of this:
`TESTED_VLLM` is the release it was checked against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.errors import ConfigError

__all__ = [
    "MEMORY_SCHEME",
    "checkpoint_format_on_meta",
    "module_of",
    "LoraMemory",
    "ReloadBuffers",
    "TESTED_VLLM",
    "cpu_experts_to_prepack",
    "prepack_cpu_experts",
    "reprocess_tied_layers",
    "serve_lora",
    "serve_loras_from_memory",
    "token_version",
]

TESTED_VLLM = "0.32."
"""The vLLM release line these attribute paths were read from."""


def token_version(engine: Any, request_id: str, index: int, position: int) -> str | None:
    """The weight version that produced output token `position` of choice `index` of the
    request `request_id` (the id given to `AsyncLLM.generate`), while the request runs; None when
    vLLM holds no record of it (finished, or no token labelled yet).

    Raises:
        ConfigError: the installed vLLM keeps its per-request records elsewhere (an upgrade past
            `TESTED_VLLM`): re-check this module against it.
    """
    try:
        processor = engine.output_processor
        internal_ids = processor.external_req_ids.get(request_id, ())
        states = processor.request_states
    except AttributeError as exc:
        raise ConfigError(f"vLLM's output processor changed ({exc}); see {__name__}") from exc
    for internal_id in list(internal_ids):
        state = states.get(internal_id)
        if state is None:
            continue
        try:
            if state.request_index != index:
                continue
            starts: list[tuple[str, int]] = list(state.weight_version_starts)
        except AttributeError as exc:
            raise ConfigError(f"vLLM's RequestState changed ({exc}); see {__name__}") from exc
        version = None
        for label, start in starts:
            if start <= position:
                version = label
        return version
    return None


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


def module_of(source: Any) -> torch.nn.Module | None:
    """The module a trainer's vLLM `ModuleSource` iterates (its `_module`), or None for any
    other source."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    if type(source) is not ModuleSource:
        return None
    module = getattr(source, "_module", None)
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"vLLM's ModuleSource keeps its module elsewhere now; see {__name__}")
    return module


@contextlib.contextmanager
def checkpoint_format_on_meta(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every layer of `model` in checkpoint format with its tensors on the meta device
    (no memory), as vLLM's layerwise reload restores them before it loads (from the metadata vLLM
    records when it builds the model), with the original weight loaders, unwrapped; a loader run
    inside writes nothing. After: every layer's live tensors put back as they were.

    Call it outside a weight update (the worker's own reload keeps them elsewhere then)."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    saved = [
        (layer, *get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)) for layer in model.modules()
    ]
    wrapped: list[tuple[torch.Tensor, Any]] = []
    """Restored tensors whose loader a past reload left wrapped in vLLM's online processing
    (which would only buffer the call), with that loader: unwrapped inside, put back after."""
    try:
        for layer, *_ in saved:
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            for tensor in get_layer_tensors(layer).values():
                loader = getattr(tensor, "weight_loader", None)
                if getattr(loader, "__name__", "") == "online_process_loader":
                    wrapped.append((tensor, loader))
                    tensor.weight_loader = _get_original_loader(tensor)
        yield
    finally:
        for tensor, loader in wrapped:
            tensor.weight_loader = loader  # type: ignore[attr-defined]
        for layer, parameters, buffers, non_persistent in saved:
            for name in get_layer_tensors(layer):
                delattr(layer, name)
            for name, parameter in parameters.items():
                layer.register_parameter(name, parameter)
            for name, buffer in buffers.items():
                layer.register_buffer(name, buffer, persistent=name not in non_persistent)
            layer._non_persistent_buffers_set = non_persistent


class ReloadBuffers:
    """What vLLM's layerwise reload keeps for layers not yet complete, made safe from buffer reuse.

    The reload buffers the arguments of a layer's weight loaders until the layer's last element
    arrived (`LayerReloadingInfo.loaded_weights`), then loads them all. A layer whose tensors span
    two buckets thus keeps views of the first bucket after `load_weights` returned. `own(batch)`,
    called after `batch` went through `load_weights` and before its memory is reused, copies each
    of those (whatever view of the batch's memory the model's loader made) into memory of its
    own. Layers that completed inside the batch hold nothing, so a push copies about one layer
    per bucket rather than every tensor.

    It finds the model's layers once, when built.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        self._infos = [info for module in model.modules() if (info := LAYERWISE_INFO.get(module)) is not None]

    def own(self, batch: list[tuple[str, torch.Tensor]]) -> int:
        """Copy what the reload keeps from `batch` out of its memory; returns the bytes copied."""
        storages = {tensor.untyped_storage().data_ptr() for _, tensor in batch} - {0}  # 0: no memory (meta, empty)
        copied = 0
        for info in self._infos:
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                        bound.arguments[key] = value.clone()
                        copied += value.nbytes
        return copied


# --- LoRA adapters from memory ------------------------------------------------------------------
#
# vLLM loads an adapter only from a path: when a request names a LoRA id its worker does not
# hold, the worker's `LRUCacheWorkerLoRAManager._load_adapter(request)` reads the adapter's
# directory. Every base-weight update also drops every adapter a worker holds
# (`reset_lora_state` after `finish_weight_update`), and the LRU cache may evict one, so an
# adapter pushed in memory must be loadable again at any step. `serve_loras_from_memory` makes
# the worker's loader take adapters whose path is `MEMORY_SCHEME...` from weightsync's own
# `LoraMemory`, built by vLLM's own `LoRAModel.from_lora_tensors` and checked by its own
# `PEFTHelper.validate_legal`; every other path loads as before.

MEMORY_SCHEME = "weightsync://"
"""The `lora_path` of an adapter held in memory: weightsync://NAME/VERSION/ID."""


class LoraMemory:
    """The adapters one worker holds in memory, by LoRA id, built as vLLM builds them."""

    def __init__(self, model: torch.nn.Module) -> None:
        manager = getattr(model, "lora_manager", None)
        if manager is None:
            raise ConfigError("vLLM serves no LoRA adapters here: start it with --enable-lora")
        self.manager = manager
        self.models: dict[int, Any] = {}

    @property
    def max_rank(self) -> int:
        return int(self.manager.lora_config.max_lora_rank)

    def supported_modules(self) -> set[str]:
        """The module names an adapter may target (packed layers' parts included)."""
        packed = self.manager.packed_modules_mapping
        found: set[str] = set()
        for module in self.manager.supported_lora_modules:
            found.update(packed.get(module, [module]))
        return found

    def build(self, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Any:
        """vLLM's LoRAModel of `tensors` (PEFT names) under `lora_id`, checked as vLLM checks one."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(self.manager.lora_config)
        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=self.manager.lora_config.lora_dtype,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )


def serve_loras_from_memory(memory: LoraMemory) -> None:
    """Make the worker that owns `memory.manager` load `weightsync://` adapters from `memory`.

    Raises:
        ConfigError: the installed vLLM's worker LoRA manager is not where it was (an upgrade).
    """
    import gc

    from vllm.lora.worker_manager import WorkerLoRAManager

    workers = [
        owner
        for owner in gc.get_referrers(memory.manager)
        if isinstance(owner, WorkerLoRAManager) and getattr(owner, "_adapter_manager", None) is memory.manager
    ]
    if len(workers) != 1 or not callable(getattr(workers[0], "_load_adapter", None)):
        raise ConfigError(f"vLLM's worker LoRA manager changed; see {__name__}")
    (worker,) = workers
    load_from_path = worker._load_adapter

    def load(request: Any) -> Any:
        if not str(request.lora_path).startswith(MEMORY_SCHEME):
            return load_from_path(request)
        held = memory.models.get(request.lora_int_id)
        if held is None:
            raise ConfigError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) is no longer held here")
        return held

    worker._load_adapter = load


def serve_lora(serving_models: Any, name: str, lora_id: int, path: str) -> None:
    """Route the OpenAI API's requests for `name` to the adapter `lora_id` (vLLM's
    `OpenAIServingModels.lora_requests`, which `load_lora_adapter` fills from a path)."""
    from vllm.lora.request import LoRARequest

    requests = getattr(serving_models, "lora_requests", None)
    if not isinstance(requests, dict):
        raise ConfigError(f"vLLM's OpenAIServingModels changed; see {__name__}")
    requests[name] = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
