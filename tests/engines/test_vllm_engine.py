"""The vllm engine on its own: dummy load, syncs through vLLM's reload, greedy equals loading
from disk and transformers, bad pushes refused before any byte reaches vLLM, failed syncs.

Skipped where vLLM is not installed (scripts/install-vllm.sh installs its CPU build). One engine
per model and load format for the whole module: building one takes seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from tests.models import save_model  # noqa: E402
from weightsync import WeightReceiver, WeightSender  # noqa: E402
from weightsync.engines.base import SamplingParams  # noqa: E402
from weightsync.engines.vllm import VLLMEngine  # noqa: E402
from weightsync.errors import PlanError, SinkError  # noqa: E402
from weightsync.source import TensorMeta  # noqa: E402

# vLLM's own imports and start-up raise FutureWarning/DeprecationWarning from its dependencies.
pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

PROMPTS = [[5, 6, 7, 8], [20, 30, 40], [3, 3, 3, 3, 3, 3]]
GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """qwen2 (tied, fp32), the same shape with other weights, and llama (untied, bf16)."""
    root = tmp_path_factory.mktemp("vllm-models")
    paths = {"qwen2": root / "qwen2", "qwen2-other": root / "qwen2-other", "llama": root / "llama"}
    save_model("qwen2", paths["qwen2"], seed=0)
    save_model("qwen2", paths["qwen2-other"], seed=1)
    save_model("llama", paths["llama"], seed=0)
    return paths


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> Iterator[VLLMEngine]:
    engine = VLLMEngine(models["qwen2"], "dummy", max_model_len=256, kv_cache_bytes=64 << 20)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def auto_engine(models: dict[str, Path]) -> Iterator[VLLMEngine]:
    engine = VLLMEngine(models["qwen2"], "auto", max_model_len=256, kv_cache_bytes=64 << 20)
    yield engine
    engine.close()


def generate(engine: VLLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    for _ in range(params.max_tokens + 4):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            tokens += output.new_token_ids
    assert not engine.has_unfinished()
    return tokens


def transformers_greedy(model_dir: Path, prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def push(engine: VLLMEngine, tensors: object, version: int, transport: str = "shm") -> tuple[bool, str, str]:
    """Push through a fresh receiver on the engine's sink: (committed?, receiver state, error)."""
    with (
        WeightReceiver(engine.weight_sink(), transport) as receiver,
        WeightSender([receiver.address], bucket_bytes=64 << 10, timeout=60) as sender,
    ):
        report = sender.push(tensors, version)
        return report.ok, receiver.state, receiver.last_error


@pytest.fixture(scope="module")
def synced(engine: VLLMEngine, models: dict[str, Path]) -> VLLMEngine:
    """The dummy engine after one push of the qwen2 checkpoint."""
    ok, state, error = push(engine, load_file(models["qwen2"] / "model.safetensors"), 1)
    assert ok and state == "ready", error
    return engine


def test_dummy_engine_starts_without_the_checkpoint(engine: VLLMEngine, auto_engine: VLLMEngine) -> None:
    assert engine.layout.ties == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert engine.weight_bytes() == auto_engine.weight_bytes() > 0
    assert engine.layout.tensors["model.norm.weight"] == ((128,), torch.float32)  # config dtype, not vLLM's bf16


@pytest.mark.parametrize("prompt", PROMPTS)
def test_pushed_weights_equal_auto_load_and_transformers(
    synced: VLLMEngine, auto_engine: VLLMEngine, models: dict[str, Path], prompt: list[int]
) -> None:
    tokens = generate(synced, prompt)
    assert tokens == generate(auto_engine, prompt)
    assert tokens == transformers_greedy(models["qwen2"], prompt)


def test_step_outputs_are_deltas_with_logprobs(synced: VLLMEngine) -> None:
    synced.add_request("a", PROMPTS[0], SamplingParams(max_tokens=5, logprobs=0))
    outputs = []
    while synced.has_unfinished():
        outputs += synced.step()
    assert all(len(o.new_token_ids) == 1 and len(o.new_logprobs or []) == 1 for o in outputs)
    assert all(lp <= 0.0 for o in outputs for lp in o.new_logprobs or [])
    assert [o.finished for o in outputs][-1] and outputs[-1].finish_reason in ("stop", "length")


def test_abort_ends_a_request(synced: VLLMEngine) -> None:
    synced.add_request("gone", PROMPTS[1], SamplingParams(max_tokens=50))
    synced.step()
    synced.abort("gone")
    assert not synced.has_unfinished()
    assert synced.step() == []


def bad_checkpoints() -> list[tuple[str, object, str]]:
    def unknown(c: dict) -> None:
        c["model.layers.0.mlp.bogus.weight"] = torch.zeros(4)

    def shape(c: dict) -> None:
        c["model.norm.weight"] = torch.zeros(3)

    def dtype(c: dict) -> None:
        c["model.norm.weight"] = c["model.norm.weight"].to(torch.bfloat16)

    def missing(c: dict) -> None:
        del c["model.layers.1.self_attn.q_proj.weight"]

    def no_embedding(c: dict) -> None:
        del c["model.embed_tokens.weight"]

    return [
        ("unknown", unknown, "unknown tensor 'model.layers.0.mlp.bogus.weight'"),
        ("shape", shape, "'model.norm.weight': sent float32[3], expected float32[128]"),
        ("dtype", dtype, "'model.norm.weight': sent bfloat16[128], expected float32[128]"),
        ("missing", missing, "plan lacks 'model.layers.1.self_attn.q_proj.weight'"),
        ("tied", no_embedding, "plan lacks 'model.embed_tokens.weight' / 'lm_head.weight'"),
    ]


@pytest.mark.parametrize(("case", "change", "message"), bad_checkpoints(), ids=[c[0] for c in bad_checkpoints()])
def test_bad_push_is_refused_before_vllm_sees_it(
    synced: VLLMEngine, models: dict[str, Path], case: str, change, message: str
) -> None:
    before = generate(synced, PROMPTS[0])
    checkpoint = load_file(models["qwen2-other"] / "model.safetensors")
    change(checkpoint)
    ok, state, error = push(synced, checkpoint, 99)
    assert not ok and message in error and "checkpoint layout" in error
    assert not synced._loader.loading
    assert generate(synced, PROMPTS[0]) == before


def test_second_push_changes_outputs_and_back(synced: VLLMEngine, models: dict[str, Path]) -> None:
    original = generate(synced, PROMPTS[0])
    ok, _, error = push(synced, load_file(models["qwen2-other"] / "model.safetensors"), 2, "inproc")
    assert ok, error
    other = generate(synced, PROMPTS[0])
    assert other != original
    assert other == transformers_greedy(models["qwen2-other"], PROMPTS[0])
    ok, _, error = push(synced, load_file(models["qwen2"] / "model.safetensors"), 3, "tcp")
    assert ok, error
    assert generate(synced, PROMPTS[0]) == original


def test_tied_weight_sent_under_lm_head_name(synced: VLLMEngine, models: dict[str, Path]) -> None:
    expected = generate(synced, PROMPTS[2])
    checkpoint = load_file(models["qwen2-other"] / "model.safetensors")
    assert push(synced, checkpoint, 4)[0]
    checkpoint = load_file(models["qwen2"] / "model.safetensors")
    checkpoint["lm_head.weight"] = checkpoint.pop("model.embed_tokens.weight")
    ok, _, error = push(synced, checkpoint, 5)
    assert ok, error
    assert generate(synced, PROMPTS[2]) == expected


class FailingSource:
    """The qwen2 checkpoint, except that its last tensor comes out with the wrong shape: the
    sender aborts the sync after the earlier buckets already reached vLLM."""

    def __init__(self, checkpoint: dict[str, torch.Tensor]) -> None:
        self.items = list(checkpoint.items())

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self.items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, (name, tensor) in enumerate(self.items):
            yield name, (tensor[:1] if index == len(self.items) - 1 else tensor)


def test_failed_sync_after_loading_marks_the_engine_dirty_until_a_good_one(
    synced: VLLMEngine, models: dict[str, Path]
) -> None:
    expected = generate(synced, PROMPTS[0])
    with pytest.raises(PlanError, match="source yielded"):
        push(synced, FailingSource(load_file(models["qwen2-other"] / "model.safetensors")), 6)
    assert not synced._loader.loading
    with pytest.raises(SinkError, match="incomplete"):
        synced.add_request("x", PROMPTS[0], GREEDY)
    ok, _, error = push(synced, load_file(models["qwen2"] / "model.safetensors"), 7)
    assert ok, error
    assert generate(synced, PROMPTS[0]) == expected


def test_llama_bf16_push_equals_auto_load(models: dict[str, Path]) -> None:
    dummy = VLLMEngine(models["llama"], "dummy", max_model_len=256, kv_cache_bytes=64 << 20)
    try:
        assert dummy.layout.ties == ()
        ok, _, error = push(dummy, load_file(models["llama"] / "model.safetensors"), 1)
        assert ok, error
        pushed = [generate(dummy, prompt) for prompt in PROMPTS]
    finally:
        dummy.close()
    auto = VLLMEngine(models["llama"], "auto", max_model_len=256, kv_cache_bytes=64 << 20)
    try:
        assert pushed == [generate(auto, prompt) for prompt in PROMPTS]
    finally:
        auto.close()
