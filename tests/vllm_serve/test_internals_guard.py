"""Fails loudly when a vLLM upgrade moves the internals weightsync reads (integrations/vllm/internals.py):
the output processor's per-request weight version records behind streamed chunks' versions, what
the layerwise reload buffers for a layer not yet complete, and what the CPU backend's reload
leaves stale."""

from __future__ import annotations

import inspect

import pytest
import torch

from weightsync.errors import ConfigError
from weightsync.integrations.vllm.internals import TESTED_VLLM, ReloadBuffers, token_version

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

RECHECK = "vLLM was upgraded: re-read weightsync/integrations/vllm/internals.py against it, then update TESTED_VLLM"


def test_the_vllm_release_is_the_one_internals_was_checked_against() -> None:
    import vllm

    assert vllm.__version__.startswith(TESTED_VLLM), f"vLLM {vllm.__version__}: {RECHECK}"


def test_the_output_processor_still_keeps_per_request_version_starts() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    processor = OutputProcessor(None, log_stats=False)
    assert isinstance(processor.request_states, dict), RECHECK
    assert processor.external_req_ids.get("absent", ()) == (), RECHECK
    source = inspect.getsource(RequestState)
    for needed in ("self.weight_version_starts", "self.request_index", "def track_weight_version"):
        assert needed in source, f"RequestState lost {needed!r}: {RECHECK}"
    assert token_version(type("Engine", (), {"output_processor": processor})(), "absent", 0, 0) is None


def test_a_changed_engine_is_named_not_silently_unlabelled() -> None:
    with pytest.raises(ConfigError, match="output processor changed"):
        token_version(object(), "request", 0, 0)


def test_token_version_reads_the_span_that_holds_the_token() -> None:
    state = type("State", (), {"request_index": 1, "weight_version_starts": [("1", 0), ("2", 4)]})()
    processor = type("Processor", (), {"external_req_ids": {"r": ["r-a"]}, "request_states": {"r-a": state}})()
    engine = type("Engine", (), {"output_processor": processor})()
    assert [token_version(engine, "r", 1, position) for position in (0, 3, 4, 9)] == ["1", "1", "2", "2"]
    assert token_version(engine, "r", 0, 0) is None  # another choice of the request


def test_the_reload_fixes_still_find_what_they_read() -> None:
    """What reprocess_tied_layers and the CPU experts' repacking read after a layerwise reload."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    assert callable(getattr(UnquantizedEmbeddingMethod, "process_weights_after_loading", None)), RECHECK
    assert callable(getattr(CPUUnquantizedExperts, "process_weights_after_loading", None)), RECHECK
    info = get_layerwise_info(torch.nn.Linear(2, 2))
    assert callable(getattr(info, "can_load", None)) and hasattr(info, "load_numel"), RECHECK


def _reloading_linear() -> torch.nn.Module:
    from vllm.model_executor.model_loader.reload.layerwise import (
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    record_metadata_for_reloading(model)
    initialize_layerwise_reload(model)
    return model


@pytest.mark.parametrize("owned", [True, False])
def test_a_layer_that_spans_two_buckets_keeps_the_first_buckets_values(owned: bool) -> None:
    """vLLM's layerwise reload keeps a view of the first bucket until the layer's bias arrives in
    the second; the receiver reuses the first bucket's buffer in between. `ReloadBuffers.own`
    copies what vLLM keeps; without it, the layer loads what the buffer held later."""
    model = _reloading_linear()
    layer = model[0]
    buffer = torch.arange(20, dtype=torch.float32)  # the transport's buffer
    weight, bias = buffer[:16].view(4, 4), buffer[16:]
    expected = weight.clone()
    layer.weight.weight_loader(layer.weight, weight)  # bucket 1: the weight
    buffers = ReloadBuffers(model)
    copied = buffers.own([("0.weight", weight)]) if owned else 0
    buffer.fill_(-1.0)  # the receiver lands bucket 2 where bucket 1 was
    layer.bias.weight_loader(layer.bias, bias)  # bucket 2: the bias completes the layer
    if owned:
        assert copied == weight.nbytes
        assert torch.equal(layer.weight.detach(), expected)
    else:
        assert torch.equal(layer.weight.detach(), torch.full((4, 4), -1.0)), f"vLLM no longer buffers views: {RECHECK}"
    assert torch.equal(layer.bias.detach(), torch.full((4,), -1.0))


def test_a_layer_complete_inside_its_bucket_costs_no_copy() -> None:
    model = _reloading_linear()
    layer = model[0]
    buffer = torch.arange(20, dtype=torch.float32)
    batch = [("0.weight", buffer[:16].view(4, 4)), ("0.bias", buffer[16:])]
    layer.weight.weight_loader(layer.weight, batch[0][1])
    layer.bias.weight_loader(layer.bias, batch[1][1])
    assert ReloadBuffers(model).own(batch) == 0
    assert torch.equal(layer.weight.detach(), buffer[:16].view(4, 4))


def test_loras_from_memory_still_reach_what_they_read() -> None:
    """What serving LoRA adapters from memory reads: the model's `lora_manager`, the worker
    manager's `_load_adapter` (and its `_adapter_manager`), vLLM's builders of a LoRA model, and
    the OpenAI layer's name -> LoRARequest table. The end-to-end tests (tests/server/test_lora.py)
    run them on a real server."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    assert issubclass(LRUCacheWorkerLoRAManager, WorkerLoRAManager), RECHECK
    assert callable(getattr(WorkerLoRAManager, "_load_adapter", None)), RECHECK
    assert "self._adapter_manager = lora_manager" in inspect.getsource(WorkerLoRAManager.create_lora_manager), RECHECK
    assert "self.model.lora_manager = self" in inspect.getsource(LoRAModelManager.__init__), RECHECK
    assert "self._load_adapter(lora_request)" in inspect.getsource(LRUCacheWorkerLoRAManager.add_adapter), RECHECK
    built = inspect.signature(LoRAModel.from_lora_tensors).parameters
    for needed in ("lora_model_id", "tensors", "peft_helper", "device", "dtype", "weights_mapper", "skip_prefixes"):
        assert needed in built, f"LoRAModel.from_lora_tensors lost {needed!r}: {RECHECK}"
    assert callable(getattr(PEFTHelper, "from_dict", None)) and callable(PEFTHelper.validate_legal), RECHECK
    assert "self.lora_requests: dict[str, LoRARequest]" in inspect.getsource(OpenAIServingModels.__init__), RECHECK


def test_a_worker_without_lora_says_how_to_serve_adapters() -> None:
    from weightsync.integrations.vllm.internals import LoraMemory

    with pytest.raises(ConfigError, match="--enable-lora"):
        LoraMemory(torch.nn.Linear(2, 2))
