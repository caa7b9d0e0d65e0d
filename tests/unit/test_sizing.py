"""sizing.py and hf_config.py: the bucket that fits a model's embedding, the automatic size, and the negotiated one."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

from weightsync import ConfigError, NegotiationError, auto_bucket_bytes, min_bucket_bytes
from weightsync.sizing import negotiate_bucket_bytes, parse_bucket_bytes

MIB = 1 << 20


# --- min_bucket_bytes ---------------------------------------------------------------------------


def test_min_bucket_bytes_qwen2_config_defaults_to_bfloat16():
    config = transformers.Qwen2Config(vocab_size=1000, hidden_size=64)
    assert min_bucket_bytes(config) == 1000 * 64 * 2


def test_min_bucket_bytes_reads_the_config_dtype():
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, dtype="float32")
    assert min_bucket_bytes(config) == 1000 * 64 * 4


def test_min_bucket_bytes_explicit_dtype_wins_over_the_config():
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, dtype="float32")
    assert min_bucket_bytes(config, dtype=torch.float16) == 1000 * 64 * 2
    assert min_bucket_bytes(config, dtype="float8_e4m3fn") == 1000 * 64
    assert min_bucket_bytes(config, dtype="float64") == 1000 * 64 * 8


def test_min_bucket_bytes_vision_language_config_reads_text_config():
    config = transformers.LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": 500, "hidden_size": 32},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 48, "num_attention_heads": 4},
    )
    assert getattr(config, "vocab_size", None) is None, "the sizes live only in text_config"
    assert min_bucket_bytes(config) == 500 * 32 * 2


def test_min_bucket_bytes_text_config_dtype_falls_back_to_the_top_level():
    config = transformers.LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": 500, "hidden_size": 32}, dtype="float32"
    )
    assert min_bucket_bytes(config) == 500 * 32 * 4


def test_min_bucket_bytes_plain_dicts():
    assert min_bucket_bytes({"vocab_size": 151936, "hidden_size": 896}) == 151936 * 896 * 2
    assert min_bucket_bytes({"vocab_size": 10, "hidden_size": 10, "torch_dtype": "float32"}) == 448  # 400 aligned up
    nested = {"text_config": {"vocab_size": 1024, "hidden_size": 8, "dtype": "float16"}, "vision_config": {}}
    assert min_bucket_bytes(nested) == 1024 * 8 * 2
    assert min_bucket_bytes(nested, dtype=torch.float32) == 1024 * 8 * 4


def test_min_bucket_bytes_prefers_the_top_level_when_complete():
    config = {"vocab_size": 100, "hidden_size": 64, "text_config": {"vocab_size": 7, "hidden_size": 7}}
    assert min_bucket_bytes(config, dtype=torch.float32) == 100 * 64 * 4


@given(vocab=st.integers(1, 300_000), hidden=st.integers(1, 16_384), dtype=st.sampled_from(["bfloat16", "float32"]))
def test_min_bucket_bytes_is_the_aligned_embedding_size(vocab, hidden, dtype):
    size = min_bucket_bytes({"vocab_size": vocab, "hidden_size": hidden}, dtype=dtype)
    embedding = vocab * hidden * (2 if dtype == "bfloat16" else 4)
    assert size % 64 == 0
    assert embedding <= size < embedding + 64


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"vocab_size": 1000},
        {"hidden_size": 64},
        {"vocab_size": 0, "hidden_size": 64},
        {"vocab_size": -5, "hidden_size": 64},
        {"vocab_size": "1000", "hidden_size": 64},
        {"text_config": {"vocab_size": 1000}},
        {"text_config": None},
        transformers.PretrainedConfig(),
    ],
    ids=["empty", "no-hidden", "no-vocab", "zero", "negative", "string", "nested-incomplete", "nested-none", "bare"],
)
def test_min_bucket_bytes_missing_fields_is_a_config_error(config):
    with pytest.raises(ConfigError, match="vocab_size and hidden_size"):
        min_bucket_bytes(config)


@pytest.mark.parametrize("dtype", ["bf16", "Size", "not_a_dtype"])
def test_min_bucket_bytes_unknown_dtype_is_a_config_error(dtype):
    with pytest.raises(ConfigError, match="dtype"):
        min_bucket_bytes({"vocab_size": 10, "hidden_size": 10}, dtype=dtype)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        min_bucket_bytes({})


# --- auto_bucket_bytes ----------------------------------------------------------------------------


@given(
    largest=st.integers(0, 1 << 31),
    total=st.integers(0, 1 << 40),
    budget=st.integers(128, 1 << 32),
    slots=st.integers(1, 16),
)
def test_auto_bucket_bytes_properties(largest, total, budget, slots):
    if budget < slots * 64:
        with pytest.raises(ConfigError):
            auto_bucket_bytes(largest, total, memory_budget_bytes=budget, num_slots=slots)
        return
    size = auto_bucket_bytes(largest, total, memory_budget_bytes=budget, num_slots=slots)
    needs = max(-(-max(largest, total // 16) // 64) * 64, 64)
    assert size % 64 == 0 and size >= 64
    assert size <= 64 * MIB, "never above 64 MiB"
    assert size * slots <= budget, "all slots fit the budget"
    assert size <= needs, "never larger than the largest tensor or a sixteenth of the sync needs"
    if needs <= 64 * MIB and needs * slots <= budget:
        assert size == needs, "the largest tensor and a sixteenth of the sync fit whole when affordable"


def test_auto_bucket_bytes_examples():
    assert auto_bucket_bytes(1000) == 1024
    assert auto_bucket_bytes(24 * MIB, 1 << 30) == 64 * MIB  # small tensors, a large model: fewer boundaries
    assert auto_bucket_bytes(24 * MIB, 128 * MIB) == 24 * MIB
    assert auto_bucket_bytes(0) == 64
    assert auto_bucket_bytes(10**12) == 64 * MIB
    assert auto_bucket_bytes(10**12, largest_bytes=256 * MIB) == 256 * MIB  # nixl's
    assert auto_bucket_bytes(10**12, memory_budget_bytes=100 * MIB, largest_bytes=256 * MIB) == 50 * MIB
    assert auto_bucket_bytes(10**12, memory_budget_bytes=100 * MIB) == 50 * MIB
    assert auto_bucket_bytes(10**12, memory_budget_bytes=100 * MIB, num_slots=3) == (100 * MIB // 3) // 64 * 64


# --- parse / negotiate ---------------------------------------------------------------------------


def test_parse_bucket_bytes():
    assert parse_bucket_bytes("auto") is None
    assert parse_bucket_bytes(" AUTO ") is None
    assert parse_bucket_bytes(4096) == 4096
    assert parse_bucket_bytes("4096") == 4096
    assert parse_bucket_bytes(100) == 64, "aligned down"
    for bad in [0, 63, -64, True, 1.5e6, "lots", None, [4096]]:
        with pytest.raises(ConfigError):
            parse_bucket_bytes(bad)  # type: ignore[arg-type]


@given(
    proposed=st.integers(64, 1 << 30),
    limits=st.dictionaries(st.text(min_size=1, max_size=4), st.integers(64, 1 << 30), max_size=5),
)
def test_negotiate_agrees_on_the_smallest_aligned_size(proposed, limits):
    agreed = negotiate_bucket_bytes(proposed, limits)
    assert agreed == min([proposed, *limits.values()]) // 64 * 64


def test_negotiate_refuses_below_the_floor_and_names_the_receiver():
    limits = {"tcp://a:1": 1 << 20, "tcp://b:2": 4096}
    assert negotiate_bucket_bytes(1 << 22, limits, floor=4096) == 4096
    with pytest.raises(NegotiationError, match=r"tcp://b:2.*4096.*8192"):
        negotiate_bucket_bytes(1 << 22, limits, floor=8192)
