"""weightsync into stock SGLang (0.5.23), end to end, through SGLang's own doors.

A real `python -m sglang.launch_server` (from SGLang's own venv: scripts/install-sglang.sh) starts
on a tiny Qwen2 checkpoint (tied embeddings, biases, one KV head: replicated under TP=2) with
weightsync's loader as its one extra flag, at tensor parallel size 1 and 2, one server per size
for the whole module. The trainer side is `SGLangEngine` alone. Checked:

- pushes over shm and tcp land whole in every TP worker (TP=2 needs two GPUs: SGLang's CPU path
  does not start at TP=2): greedy output equals transformers' on
  the pushed weights, and after pushing back the checkpoint the server started on, SGLang's own
  per-rank checksums (`/weights_checker`) equal those of its own load from disk, on every rank;
  the version is labelled (`weight_version`) only then;
- a push that fails mid-way (the trainer's source dies half way) raises SyncFailed and leaves
  the previous version serving, labelled as before, with generation going on; so does a plan
  that lacks a tensor (refused before any byte moves); the next push lands.

Skipped where SGLang's venv is absent (WEIGHTSYNC_SKIP_SGLANG=1 skips installing it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.models import save_model
from weightsync import SenderOptions, StateDictSource, SyncFailed
from weightsync.integrations.sglang import SGLangEngine
from weightsync_bench.sglang_server import SGLangServer, gpu_count, sglang_venv

VENV = sglang_venv()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.skipif(VENV is None, reason="SGLang's venv is absent (scripts/install-sglang.sh makes it)"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

PROMPTS = [[10, 20, 30, 40], [5, 6, 7]]
SMALL_BUCKET = 96 << 10
"""About a sixth of the model: tensors span buckets."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    paths = [tmp_path_factory.mktemp(f"qwen2_seed{seed}") for seed in (0, 1)]
    for seed, path in enumerate(paths):
        save_model("qwen2", path, seed=seed)
    return paths


TP2_ON_CPU = (
    "SGLang 0.5.23's CPU path does not start at TP=2: its in-tree CPU platform makes every TP group "
    "build a PyNccl communicator, which fails on a CPU device (docs/integrations/sglang.md)"
)


@pytest.fixture(
    scope="module",
    params=[1, pytest.param(2, marks=pytest.mark.skipif(gpu_count() < 2, reason=TP2_ON_CPU))],
    ids=["tp1", "tp2"],
)
def server(request: pytest.FixtureRequest, checkpoints: list[Path]) -> Iterator[SGLangServer]:
    """Stock SGLang on checkpoint 0, with weightsync's loader."""
    assert VENV is not None
    with SGLangServer(VENV, checkpoints[0], tp=request.param) as served:
        yield served


@pytest.fixture(scope="module")
def weights(checkpoints: list[Path]) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [load_file(path / "model.safetensors") for path in checkpoints]


@pytest.fixture(scope="module")
def references(checkpoints: list[Path]) -> list[list[list[int]]]:
    """Transformers' greedy output of each checkpoint on every prompt."""
    from transformers import AutoModelForCausalLM

    outputs = []
    for path in checkpoints:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            runs = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False) for p in PROMPTS]
        outputs.append([[int(t) for t in run[0, len(p) :]] for run, p in zip(runs, PROMPTS, strict=True)])
    return outputs


def _greedy(url: str, prompt: list[int]) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    answer = httpx.post(f"{url}/generate", json=body, timeout=120)
    answer.raise_for_status()
    return list(answer.json()["output_ids"])


def _checksums(url: str) -> list[dict[str, str]]:
    """SGLang's own checksums of every parameter, one mapping per TP rank."""
    answer = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=120)
    answer.raise_for_status()
    return [dict(rank["checksums"]) for rank in answer.json()["ranks"]]


def _label(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"])


@pytest.fixture(scope="module")
def loaded(server: SGLangServer) -> list[dict[str, str]]:
    """SGLang's checksums of checkpoint 0 as it loaded it from disk at start."""
    return _checksums(server.url)


_versions = iter(range(1, 1000))


def _engine(url: str, transport: str = "shm", **options: object) -> SGLangEngine:
    sender = SenderOptions(**{"verify": "full", "timeout": 30, "bucket_bytes": SMALL_BUCKET} | options)  # type: ignore[arg-type]
    return SGLangEngine(url, transport=transport, options=sender, deadline=60)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stock_sglang_takes_pushes_whole_in_every_tp_worker(server, loaded, weights, references, transport) -> None:
    with _engine(server.url, transport) as engine:
        workers = engine.connect()
        assert [worker.rank for worker in workers] == list(range(len(loaded)))
        version = next(_versions)
        report = engine.push(weights[1], version=version)
        assert report.ok and len(report.outcomes) == len(loaded)
        assert _label(server.url) == str(version)
        assert [_greedy(server.url, prompt) for prompt in PROMPTS] == references[1]
        pushed = _checksums(server.url)
        assert all(ranked != before for ranked, before in zip(pushed, loaded, strict=True))

        version = next(_versions)
        engine.push(weights[0], version=version)  # back to what SGLang loaded from disk
        assert _checksums(server.url) == loaded  # every parameter, every TP rank, bit for bit
        assert _label(server.url) == str(version)
        assert [_greedy(server.url, prompt) for prompt in PROMPTS] == references[0]


class _DiesHalfway(StateDictSource):
    """A trainer's source that fails after half its tensors (the trainer dies mid-push)."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(super().tensors()):
            if index == len(self.metas()) // 2:
                raise RuntimeError("the trainer died half way")
            yield pair


def test_a_push_failing_midway_leaves_the_previous_version_serving(server, loaded, weights, references) -> None:
    with _engine(server.url, "tcp") as engine:
        good = next(_versions)
        engine.push(weights[0], version=good)
        with pytest.raises(SyncFailed, match="previous weights serve"):
            engine.push(_DiesHalfway(weights[1]), version=next(_versions))
        assert _label(server.url) == str(good)
        assert _checksums(server.url) == loaded
        assert [_greedy(server.url, prompt) for prompt in PROMPTS] == references[0]  # generation goes on

        lacking = {name: tensor for name, tensor in weights[1].items() if "layers.1.mlp.up_proj" not in name}
        with pytest.raises(SyncFailed, match="plan lacks 'model.layers.1.mlp.up_proj.weight'"):
            engine.push(lacking, version=next(_versions))
        assert _label(server.url) == str(good) and _checksums(server.url) == loaded

        version = next(_versions)
        engine.push(weights[1], version=version)  # the next push lands
        assert _label(server.url) == str(version)
        assert [_greedy(server.url, prompt) for prompt in PROMPTS] == references[1]


def test_the_loader_alone_takes_no_weights(server) -> None:
    """SGLang's update call with weights (not a weightsync control message) under weightsync's
    loader changes nothing and leaves SGLang running: the loader never raises inside SGLang."""
    import base64
    import io
    import pickle

    before = _checksums(server.url)
    buffer = io.BytesIO()
    pickle.dump([("model.norm.weight", torch.zeros(128))], buffer)
    body = {
        "serialized_named_tensors": [base64.b64encode(buffer.getvalue()).decode()] * len(before),
        "load_format": "weightsync.integrations.sglang.load_weights",
        "flush_cache": True,
    }
    httpx.post(f"{server.url}/begin_weight_update", json={}, timeout=60).raise_for_status()
    try:
        httpx.post(f"{server.url}/update_weights_from_tensor", json=body, timeout=60).raise_for_status()
    finally:
        httpx.post(f"{server.url}/end_weight_update", json={}, timeout=60).raise_for_status()
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    assert _checksums(server.url) == before


def test_a_trainer_that_died_inside_a_round_is_recovered_by_the_next(server, weights, references) -> None:
    """A round left open (generation paused, SGLang's update session open) by a trainer that died:
    the next trainer's connect ends the session, and its first push lands and resumes generation."""
    httpx.post(f"{server.url}/pause_generation", json={"mode": "abort"}, timeout=60).raise_for_status()
    httpx.post(f"{server.url}/begin_weight_update", json={}, timeout=60).raise_for_status()
    with _engine(server.url, "shm") as engine:
        version = next(_versions)
        engine.push(weights[1], version=version)
        assert _label(server.url) == str(version)
        assert [_greedy(server.url, prompt) for prompt in PROMPTS] == references[1]
