"""Megatron-Core trainer ranks push what they hold into stock vLLM, with no gather.

A real vLLM server (TP=2, then TP=1; the tiny Qwen3-MoE loaded from its checkpoint on disk) and,
pushed into it in turn, a real 2-rank Megatron-Core trainer (`weightsync_bench.megatron_ranks`,
gloo) at tensor, pipeline and expert parallel layouts: every rank calls vLLM's trainer API with
`sharded=True` and a `MegatronSource`. After each push, what every worker serves equals, tensor
by tensor (vLLM's per-parameter checksums), what vLLM loaded from disk and what a full push of
the same weights gives; each TP=2 worker receives at most 0.55x the bytes of a full push; and
the greedy output is vLLM's own from disk.

Skipped where vLLM or megatron-core is not installed (scripts/install-vllm.sh,
scripts/install-megatron.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from tests.integrations import test_vllm_backend as vllm  # noqa: E402
from tests.integrations import test_vllm_sharded  # noqa: E402
from tests.integrations.test_megatron import ranks  # noqa: E402
from tests.integrations.test_vllm_sharded import FromDisk, _full_push  # noqa: E402
from tests.models import save_model  # noqa: E402

pytestmark = test_vllm_sharded.pytestmark

MOST_OF_A_FULL_PUSH = 0.55
"""What a TP=2 worker may receive, as a fraction of a full push's bytes (issue 49)."""

LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
"""The trainer's (TP, PP, EP), two ranks each."""


@pytest.fixture(scope="module", params=[2, 1], ids=["vllm-tp2", "vllm-tp1"])
def server(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FromDisk, int]]:
    """Stock vLLM at TP=`param` with the weightsync backend, started on the checkpoint's weights."""
    checkpoint = tmp_path_factory.mktemp("qwen3_moe")
    save_model("qwen3_moe", checkpoint)
    with vllm.stock_vllm(checkpoint, "qwen3_moe", request.param, load_format="auto") as served:
        url = served.url
        yield (
            FromDisk(served, [vllm._greedy(url, prompt) for prompt in vllm.PROMPTS], vllm._checksums(url)),
            request.param,
        )


def test_megatron_layouts_push_their_shards_into_vllm(server: tuple[FromDisk, int], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    disk, tp = server
    url = disk.served.url
    full_bytes = sum(tensor.nbytes for tensor in load_file(disk.served.checkpoint / "model.safetensors").values())
    httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    try:
        _full_push(disk.served, version=1)
        full = vllm._checksums(url)  # a full push of the checkpoint's weights, what every layout's must equal
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()
    for index, layout in enumerate(LAYOUTS):
        version = 10 * (index + 1)
        out = tmp_path / str(index)
        out.mkdir()
        httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
        try:
            _full_push(disk.served, version=version - 1, plus=1.0)  # other weights: the push must change them all
            pushes = ranks(disk.served.checkpoint, out, layout, version, "--vllm", url)
            sharded = vllm._checksums(url)
        finally:
            httpx.post(f"{url}/resume", timeout=30).raise_for_status()
        assert all(push["ok"] for push in pushes), (layout, pushes)
        assert all(push["whole_tensors"] == [] for push in pushes), (layout, pushes)
        assert sharded == full, f"{layout}: the Megatron push and a full push of the same weights differ"
        assert sharded == disk.checksums, f"{layout}: the Megatron push and vLLM's own load from disk differ"
        workers = pushes[0]["wire_bytes"]
        assert len(workers) == tp
        for address in workers:
            received = sum(push["wire_bytes"][address] for push in pushes)
            assert received <= (MOST_OF_A_FULL_PUSH if tp > 1 else 1.0) * full_bytes, (layout, received, full_bytes)
    assert vllm._label(url) == str(10 * len(LAYOUTS))
    assert [vllm._greedy(url, prompt) for prompt in vllm.PROMPTS] == disk.greedy  # the last layout's push serving
