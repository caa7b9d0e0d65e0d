"""Megatron-Core trainer ranks push what they hold into stock SGLang, with no gather.

A real SGLang server (TP=1, the tiny Qwen3-MoE loaded from its checkpoint on disk: SGLang's
own load is the reference) and, pushed into it in turn, a real 2-rank Megatron-Core trainer
(`weightsync_bench.megatron_ranks --sglang`, gloo) at tensor, pipeline and expert parallel
layouts: every rank builds `SGLangEngine(sharded=True)` and pushes its `MegatronSource`. After
each push, every parameter SGLang serves (its own checksums) equals what it loaded from disk and
what a full push of the same weights gives, SGLang labels the pushed version, and the greedy
output is SGLang's own from disk. One server for the module (qwen2 in the other SGLang modules:
the expert parallel layout needs the MoE).

Skipped where SGLang's venv or megatron-core is absent (scripts/install-sglang.sh,
scripts/install-megatron.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import missing_package
from tests.integrations.test_megatron import ranks
from tests.integrations.test_sglang_backend import PROMPTS, VENV, _checksums, _greedy, _label
from tests.integrations.test_sglang_backend import pytestmark as sglang_marks
from tests.models import save_model
from weightsync import SenderOptions
from weightsync.integrations.sglang import SGLangEngine
from weightsync_bench.sglang_server import SGLangServer

pytestmark = [
    *sglang_marks,
    pytest.mark.skipif(missing_package("megatron.core"), reason="megatron-core: scripts/install-megatron.sh"),
]

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
"""The trainer's (TP, PP, EP), two ranks each (as for vLLM: test_vllm_megatron.py)."""


@dataclass(frozen=True)
class FromDisk:
    """SGLang started on the checkpoint, with what it served then."""

    url: str
    checkpoint: Path
    greedy: list[list[int]]
    checksums: list[dict[str, str]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FromDisk]:
    """Stock SGLang at TP=1 with weightsync's loader, started on the checkpoint's weights."""
    assert VENV is not None
    checkpoint = tmp_path_factory.mktemp("qwen3_moe")
    save_model("qwen3_moe", checkpoint)
    with SGLangServer(VENV, checkpoint, tp=1) as served:
        url = served.url
        yield FromDisk(url, checkpoint, [_greedy(url, prompt) for prompt in PROMPTS], _checksums(url))


def _full_push(server: FromDisk, version: int, plus: float = 0.0) -> None:
    """The checkpoint's tensors (+ `plus`), pushed whole by one trainer process."""
    from safetensors.torch import load_file

    tensors = {name: tensor + plus for name, tensor in load_file(server.checkpoint / "model.safetensors").items()}
    with SGLangEngine(server.url, transport="tcp", options=SenderOptions(timeout=60), deadline=120) as engine:
        assert engine.push(tensors, version=version).ok


def test_megatron_layouts_push_their_shards_into_sglang(server: FromDisk, tmp_path: Path) -> None:
    _full_push(server, version=1)
    full = _checksums(server.url)  # a full push of the checkpoint's weights, what every layout's must equal
    for index, layout in enumerate(LAYOUTS):
        version = 10 * (index + 1)
        out = tmp_path / str(index)
        out.mkdir()
        _full_push(server, version=version - 1, plus=1.0)  # other weights: the push must change them all
        assert _checksums(server.url) != server.checksums
        pushes = ranks(server.checkpoint, out, layout, version, "--sglang", server.url)
        assert all(push["ok"] for push in pushes), (layout, pushes)
        assert all(push["whole_tensors"] == [] for push in pushes), (layout, pushes)
        assert all(push["wire_bytes"][address] > 0 for push in pushes for address in push["wire_bytes"])
        assert _label(server.url) == str(version), layout
        sharded = _checksums(server.url)
        assert [_greedy(server.url, prompt) for prompt in PROMPTS] == server.greedy, layout
        assert sharded == full, f"{layout}: the Megatron push and a full push of the same weights differ"
        assert sharded == server.checksums, f"{layout}: the Megatron push and SGLang's own load from disk differ"
