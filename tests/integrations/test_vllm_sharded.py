"""Sharded sync into stock vLLM at tensor parallel size 2, from a 2-rank FSDP2 trainer.

A real vLLM server (TP=2, dummy weights, the weightsync backend) and a real FSDP2 trainer
(`torchrun --nproc-per-node 2`, gloo, `fully_shard`: `weightsync_bench.fsdp_ranks`) whose
every rank calls vLLM's trainer API (`trainer_init`, `send_weights`) with `sharded=True`: each
rank pushes the rows it holds, and each worker is sent only the boxes its loaders keep. Checked,
for a dense Qwen2 (tied embeddings, one KV head replicated over both workers, biases) and the
tiny Qwen3-MoE, over shm and collective (parts over tcp are checked into receivers by
tests/transports/test_sharded.py): every rank's round commits and vLLM labels the version; each
worker receives at most 0.6x the bytes of a full push; what every worker serves equals, tensor by
tensor (vLLM's per-parameter checksums), what a full push of the same weights gives and what
vLLM itself loaded from the checkpoint on disk when it started; and so does its greedy output.

Skipped where vLLM is not installed (scripts/install-vllm.sh installs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from tests.integrations.test_vllm_backend import (  # noqa: E402
    PROMPTS,
    Served,
    _checksums,
    _engine,
    _greedy,
    _label,
    _Listed,
    stock_vllm,
)
from tests.models import save_model  # noqa: E402
from tests.transports.test_sharded import fsdp_ranks, stepped_weights  # noqa: E402
from weightsync.round import NOT_READY  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

MOST_OF_A_FULL_PUSH = 0.6
"""What a TP=2 worker may receive, as a fraction of a full push's bytes."""


@dataclasses.dataclass(frozen=True)
class FromDisk:
    """vLLM at TP=2, started on the checkpoint (its own load from disk), with what it served then."""

    served: Served
    greedy: list[list[int]]
    checksums: dict[str, str]


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"], ids=["qwen2-tp2", "moe-tp2"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FromDisk]:
    """Stock vLLM at TP=2 with the weightsync backend, started on the checkpoint's weights."""
    kind = request.param
    checkpoint = tmp_path_factory.mktemp(kind)
    save_model(kind, checkpoint)
    with stock_vllm(checkpoint, kind, tp=2, load_format="auto") as served:
        yield FromDisk(served, [_greedy(served.url, prompt) for prompt in PROMPTS], _checksums(served.url))


def _fsdp_push(server: Served, transport: str, out: Path, versions: int = 1) -> list[list[dict[str, object]]]:
    """Two FSDP2 ranks push the checkpoint through vLLM's trainer API, sharded; each rank's reports."""
    return fsdp_ranks(["--vllm", server.url, "--vllm-source"], server.checkpoint, transport, out, versions)


def _full_push(server: Served, version: int, plus: float = 0.0) -> None:
    """The checkpoint's tensors (+ `plus`), pushed whole by one trainer rank (a source made on
    demand: not cut per worker)."""
    from safetensors.torch import load_file

    tensors = [(name, tensor + plus) for name, tensor in load_file(server.checkpoint / "model.safetensors").items()]
    engine = _engine(server.url, _Listed(tensors))
    try:
        report = engine.send_weights(version=version)
        assert report is not None and report.ok, report
        assert all(outcome.wire_bytes == report.total_bytes for outcome in report.outcomes)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_fsdp2_ranks_push_their_shards_into_vllm_tp2(server: FromDisk, transport: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    url = server.served.url
    httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    try:
        _full_push(server.served, version=5, plus=1.0)  # other weights: the sharded push must change every parameter
        reports = _fsdp_push(server.served, transport, tmp_path, versions=2)
        sharded = _checksums(url)
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()
    served = [_greedy(url, prompt) for prompt in PROMPTS]  # what the sharded push serves
    httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    try:
        _full_push(server.served, version=10)
        full = _checksums(url)
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()
    assert all(report["ok"] for rank in reports for report in rank), reports
    assert all(report["whole_tensors"] == [] for rank in reports for report in rank)
    assert sharded == full, "the sharded push and a full push of the same weights differ"
    assert sharded == server.checksums, "the sharded push and vLLM's own load from disk differ"
    assert _label(url) == "10"

    full_bytes = sum(tensor.nbytes for tensor in load_file(server.served.checkpoint / "model.safetensors").values())
    workers = reports[0][0]["wire_bytes"]
    assert isinstance(workers, dict) and len(workers) == 2
    for address in workers:
        received = sum(rank[0]["wire_bytes"][address] for rank in reports)  # type: ignore[index]
        assert received <= MOST_OF_A_FULL_PUSH * full_bytes, (address, received, full_bytes)
    assert served == server.greedy


def test_fsdp2_ranks_push_deltas_of_their_shards_into_vllm_tp2_exact(server: FromDisk, tmp_path: Path) -> None:
    """Two FSDP2 ranks stepping between pushes (`fsdp_ranks --delta`): one full push, then three
    where every rank sends only what changed in its rows, through vLLM's trainer API into the
    workers' standby copies. vLLM ends with exactly the weights the trainer ends with: its
    parameters equal a full push of them, and the digest every rank reports is theirs."""
    from weightsync.digest import source_digest
    from weightsync.integrations.vllm import VLLMSource

    url = server.served.url
    expected = stepped_weights(server.served.checkpoint, steps=3)
    httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    try:
        target = ["--vllm", url, "--vllm-source", "--delta"]
        reports = fsdp_ranks(target, server.served.checkpoint, "tcp", tmp_path, versions=4)
        patched, label = _checksums(url), _label(url)
        engine = _engine(url, VLLMSource(expected))
        try:
            report = engine.send_weights(version=1)
            assert report is not None and report.ok, report
        finally:
            engine.shutdown()
        full = _checksums(url)
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()
    assert all(push["ok"] for rank in reports for push in rank), reports
    modes = [sorted(set(push["modes"].values())) for push in reports[0]]
    assert modes == [["full"], ["delta"], ["delta"], ["delta"]], modes
    assert label == "4"
    assert patched == full, "three sharded delta pushes and a full push of the same weights differ"
    digest = source_digest(expected)
    assert reports[0][-1]["content_digest"] == reports[1][-1]["content_digest"] == digest


def test_a_trainer_rank_that_dies_mid_push_fails_the_push_at_once_and_leaves_vllm_updatable(
    server: FromDisk, tmp_path: Path
) -> None:
    """Rank 1's process exits in the middle of the second sharded push, after vLLM's update
    window opened. Rank 0's `send_weights` raises `CollectiveError` within seconds (not gloo's
    30 minutes, not the push's timeout), labels nothing and leaves no worker inside the update:
    the next push, from another trainer, lands and is labelled."""
    url = server.served.url
    target = ["--vllm", url, "--rank1-dies"]
    httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=30).raise_for_status()
    try:
        first, second = fsdp_ranks(target, server.served.checkpoint, "shm", tmp_path, versions=2)[0]
        label = _label(url)
        _full_push(server.served, version=3)
        after = _checksums(url)
    finally:
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()
    assert first["ok"], first
    assert not second["ok"] and str(second["error"]).startswith("CollectiveError: trainer rank 0 of 2"), second
    assert float(second["seconds"]) < 60, second  # the push's own timeout is 120 s, gloo's default 30 min
    assert label == NOT_READY, "the failed push labelled no version (rank 0's part may have landed: not ready)"
    assert _label(url) == "3" and after == server.checksums, "the next push landed whole"
