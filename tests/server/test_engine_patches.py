"""Delta pushes into real engine workers: `weightsync serve --staged` on vLLM (TP=1 and TP=2) and
SGLang (TP=1), each worker patched in its standby copy, checked whole, then loaded by the engine.

One server per parametrisation for the module (an engine start costs a minute here), over tcp
(where `delta=True` sends patches). Checked:

- a full push and 5 delta pushes of sparse changes: every worker takes each patch ("delta"), the
  server's content digest is the pushed version's, `/metrics` count the delta syncs, and greedy
  output equals that of the same engine loading the final weights from disk (`weightsync push
  --model`), which differs from the first version's;
- a patch whose result does not match the sender's content digest on one worker (the commit
  that worker gets names another digest): that worker refuses the version, and the server serves
  the previous version or nothing (503), never a mix; the next push gives that worker the full
  version and serves it exactly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import WAIT_S
from tests.models import save_model
from weightsync import WeightSender, cli
from weightsync.digest import source_digest
from weightsync.messages import Commit
from weightsync.serving.process import ChildProcess
from weightsync.transports.control import SenderChannel
from weightsync_bench.sglang_server import sglang_venv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

START_S = 420.0
"""An engine's start on a loaded 2-core host."""
PROMPT = [5, 6, 7, 8]
VENV = sglang_venv()
ENGINES = {
    "vllm-tp1": ("vllm", sys.executable, "", {"VLLM_CPU_KVCACHE_SPACE": "1"}),
    "vllm-tp2": (
        "vllm",
        sys.executable,
        "--tensor-parallel-size 2 --distributed-executor-backend mp",
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    ),
    "sglang-tp1": ("sglang", str(VENV / "bin" / "python") if VENV else "", "--dtype float32", {}),
}


def _available(engine: str) -> Any:
    if engine == "sglang":
        return pytest.mark.skipif(VENV is None, reason="SGLang's venv is absent (scripts/install-sglang.sh makes it)")
    return pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


class Served:
    """One `weightsync serve --staged` process: its URL and the receiver of every worker."""

    def __init__(self, engine: str, url: str, addresses: list[str]) -> None:
        self.engine, self.url, self.addresses = engine, url, addresses
        self.http = httpx.Client(base_url=url, timeout=WAIT_S * 3)

    def greedy(self) -> httpx.Response:
        """Greedy generation from PROMPT: vLLM's completions with token ids, SGLang's /generate."""
        if self.engine == "sglang":
            body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            return self.http.post("/generate", json=body)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        return self.http.post("/v1/completions", json=body)

    def tokens(self) -> list[int]:
        answer = self.greedy()
        answer.raise_for_status()
        found = answer.json()
        return list(found["output_ids"] if self.engine == "sglang" else found["choices"][0]["token_ids"])

    def version(self) -> int | None:
        health = self.http.get("/health")
        return health.json()["version"] if health.status_code == 200 else None

    def modes(self) -> dict[str, float]:
        prefix = 'weightsync_sync_modes_total{mode="'
        lines = self.http.get("/metrics").text.splitlines()
        return {
            line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith(prefix)
        }

    def digest(self) -> str:
        return str(self.http.get("/weight_info").json()["content_digest"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("patches") / "qwen2"
    save_model("qwen2", path)
    return path


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=_available(ENGINES[name][0])) for name in ENGINES],
)
def served(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Served]:
    engine, python, engine_args, env = ENGINES[request.param]
    command = [python, "-m", "weightsync", "serve", "--engine", engine, "--model", str(model_dir), "--staged"]
    command += ["--port", "0", "--ready-timeout", "1", "--transport", "tcp", "--sync-timeout", "20"]
    command += ["--engine-args", engine_args] if engine_args else []
    process = ChildProcess(command, env=os.environ | env)
    try:
        line = process.wait_for_line("weightsync serve:", START_S)
        assert line is not None, process.why_not_started(f"weightsync serve --engine {engine} --staged", START_S)
        found = re.match(r"weightsync serve: (\S+) receiver (\S+)", line)
        assert found is not None, line
        server = Served(engine, found.group(1), found.group(2).split(","))
        yield server
        server.http.close()
    finally:
        process.close()


def sparse_step(weights: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """`weights` with about 1% of the elements of every other tensor set to new, large values."""
    generator = torch.Generator().manual_seed(step)
    changed = dict(weights)
    for index, name in enumerate(sorted(weights)):
        if (index + step) % 2:
            continue
        flat = weights[name].clone().view(-1)
        where = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=generator)
        flat[where] = torch.randn(where.numel(), generator=generator).to(flat.dtype)
        changed[name] = flat.view(weights[name].shape)
    return changed


def test_a_full_push_then_five_patches_serve_what_the_engine_loads_from_disk(
    served: Served, model_dir: Path, tmp_path: Path
) -> None:
    weights = load_file(str(model_dir / "model.safetensors"))
    before = served.modes()
    with WeightSender(served.addresses, timeout=WAIT_S * 3, delta=True, verify="bucket") as sender:
        report = sender.push(weights, 0)
        assert report.ok and [o.mode for o in report.outcomes] == ["full"] * len(served.addresses), report.failed
        first = served.tokens()
        for version in range(1, 6):
            weights = sparse_step(weights, version)
            report = sender.push(weights, version)
            assert report.ok, report.failed
            assert [o.mode for o in report.outcomes] == ["delta"] * len(served.addresses)
            assert all(o.changed_fraction < 0.02 for o in report.outcomes)
            assert served.digest() == source_digest(weights)
    patched = served.tokens()
    modes = served.modes()
    assert modes["delta"] - before["delta"] == 5 and modes["full"] - before["full"] == 1

    final = tmp_path / "final"
    shutil.copytree(model_dir, final)
    save_file(weights, str(final / "model.safetensors"))
    assert cli.main(["push", "--model", str(final), "--to", served.url, "--timeout", str(WAIT_S * 3)]) == 0
    assert served.modes()["full"] - before["full"] == 2
    assert served.tokens() == patched != first


class _WrongDigest:
    """A sender's link that names another content digest in the commits it sends."""

    def __init__(self, link: Any) -> None:
        self.link = link

    def send(self, message: Any, timeout: float) -> None:
        if isinstance(message, Commit):
            message = msgspec.structs.replace(message, content_digest="0" * len(message.content_digest))
        self.link.send(message, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)


@contextlib.contextmanager
def wrong_digest_for(address: str, version: int) -> Iterator[None]:
    """The commit of `version` names another content digest to `address`, and only to it."""
    commit = SenderChannel.commit

    def one_wrong(self: SenderChannel, message: Commit, live: Any) -> Any:
        if message.version != version or address not in live:
            return commit(self, message, live)
        link = self._links[address]
        self._links[address] = _WrongDigest(link)
        try:
            return commit(self, message, live)
        finally:
            self._links[address] = link

    SenderChannel.commit = one_wrong  # type: ignore[method-assign]
    try:
        yield
    finally:
        SenderChannel.commit = commit  # type: ignore[method-assign]


def test_a_patch_failing_on_one_worker_leaves_the_previous_version_or_nothing_served(
    served: Served, model_dir: Path
) -> None:
    weights = load_file(str(model_dir / "model.safetensors"))
    victim = served.addresses[-1]
    # The other workers' commits are answered once the server decided (within its sync timeout, 20 s).
    with WeightSender(served.addresses, timeout=WAIT_S * 9, delta=True, raise_on_failure=False) as sender:
        for version in (10, 11):
            weights = sparse_step(weights, version)
            assert sender.push(weights, version).ok
        previous = served.tokens()
        delta_before = served.modes()["delta"]

        with wrong_digest_for(victim, 12):
            report = sender.push(sparse_step(weights, 12), 12)
        failed = {o.address: o for o in report.failed}
        assert failed[victim].kind == "ChecksumError" and failed[victim].mode == "delta"
        assert len(served.addresses) > 1 or list(failed) == [victim]  # with one worker, nothing else fails
        if served.version() is not None:  # the previous version serves on
            assert served.version() == 11 and served.tokens() == previous
        else:  # not ready: nothing is served
            assert served.greedy().status_code == 503
        assert served.modes()["delta"] == delta_before

        weights = sparse_step(weights, 13)
        report = sender.push(weights, 13)
        assert report.ok, report.failed
        assert {o.address: o.mode for o in report.outcomes}[victim] == "full"
        assert served.digest() == source_digest(weights)
        assert served.version() == 13 and served.greedy().status_code == 200
