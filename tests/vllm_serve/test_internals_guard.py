"""Fails loudly when a vLLM upgrade moves the internals weightsync reads (integrations/vllm/internals.py):
the output processor's per-request weight version records behind streamed chunks' versions."""

from __future__ import annotations

import inspect

import pytest
import torch

from weightsync.errors import ConfigError
from weightsync.integrations.vllm.internals import TESTED_VLLM, token_version

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
