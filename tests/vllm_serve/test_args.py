"""vLLM's serve arguments come from vLLM's own parser: weightsync's settings first, --vllm-args
after them; what vLLM refuses, a replaced weight-transfer backend, and data parallel replicas in
one server fail before the port is taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.errors import ConfigError
from weightsync.serving.config import ServeConfig

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture
def config(tmp_path: Path) -> ServeConfig:
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    return ServeConfig(model=str(tmp_path), engine="vllm", load_format="dummy")


def test_weightsync_settings_and_extra_vllm_flags_reach_vllm(config: ServeConfig) -> None:
    from weightsync.serving.vllm.launch import vllm_namespace

    args = vllm_namespace(config, ["--max-model-len", "256", "--enable-prefix-caching", "-tp", "2"])
    assert (args.model, args.load_format, args.dtype) == (config.model, "dummy", "float32")
    assert args.weight_transfer_config.backend == "weightsync" and args.served_model_name == [config.model_name]
    assert args.tensor_parallel_size == 2
    assert args.max_model_len == 256 and args.enable_prefix_caching is True
    assert args.enforce_eager is True and args.kv_cache_memory_bytes == 1 << 30


def test_what_vllm_refuses_a_replaced_backend_and_replicas_are_config_errors(config: ServeConfig) -> None:
    from weightsync.serving.vllm.launch import vllm_namespace

    with pytest.raises(ConfigError, match="vLLM refused"):
        vllm_namespace(config, ["--no-such-flag"])
    with pytest.raises(ConfigError, match="weight-transfer-config is weightsync's own"):
        vllm_namespace(config, ["--weight-transfer-config", '{"backend": "nccl"}'])
    with pytest.raises(ConfigError, match="one weightsync serve per replica"):
        vllm_namespace(config, ["--data-parallel-size", "2"])


def test_a_chat_template_file_reaches_vllm_once(config: ServeConfig, tmp_path: Path) -> None:
    import dataclasses

    from weightsync.serving.vllm.launch import vllm_namespace

    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    templated = dataclasses.replace(config, chat_template=str(template))
    assert vllm_namespace(templated).chat_template == str(template)
    assert vllm_namespace(config).chat_template is None
    with pytest.raises(ConfigError, match="give the chat template once"):
        vllm_namespace(templated, ["--chat-template", str(template)])


@pytest.mark.parametrize(("rank", "vllms"), [(1, 1), (4, 8), (8, 8), (9, 16), (64, 64)])
def test_a_lora_rank_vllm_does_not_offer_is_rounded_up_for_its_buffers(config: ServeConfig, rank, vllms) -> None:
    """vLLM takes --max-lora-rank only from its list (1, 8, 16, ...): `weightsync serve
    --max-lora-rank 4` (the demo's default adapter) starts it at 8; pushes are still held to 4."""
    import dataclasses

    from weightsync.serving.vllm.launch import vllm_namespace

    args = vllm_namespace(dataclasses.replace(config, max_lora_rank=rank))
    assert args.enable_lora is True and args.max_lora_rank == vllms
