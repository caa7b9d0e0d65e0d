"""`weightsync serve --engine vllm --tensor-parallel-size 2`: one server, two vLLM workers, each
with its own receiver, a version labelled only once both landed it.

On vLLM's CPU backend (mp executor, one core per worker) with the tests' dense Qwen2 (one KV
head, replicated under TP=2; tied embeddings; biases) and Qwen3-MoE (4 experts, top-2): pushes
over shm (one ring, read by both workers) and tcp land bit-exact (the server's digest is the checkpoint's) and serve what
transformers generates; a worker process killed in the middle of a sync leaves every later
response from the previous version or a 503, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import WAIT_S, wait_until
from tests.leftovers import Footprints
from tests.models import save_model
from tests.server.checks import _Gated
from weightsync import WeightSender, cli
from weightsync.digest import source_digest
from weightsync.serving.process import ChildProcess

pytest.importorskip("vllm")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

START_S = 300.0
PROMPT = [5, 6, 7, 8]
TP2 = "--tensor-parallel-size 2 --distributed-executor-backend mp"
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


class Served:
    def __init__(self, process: ChildProcess, url: str, addresses: list[str]) -> None:
        self.process, self.url, self.addresses = process, url, addresses
        self.http = httpx.Client(base_url=url, timeout=WAIT_S * 3)

    def greedy(self) -> httpx.Response:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        return self.http.post("/v1/completions", json=body)

    def worker(self, rank: int) -> psutil.Process:
        """vLLM's worker process of tensor parallel rank `rank`."""
        for child in psutil.Process(self.process.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if f"Worker_TP{rank}" in " ".join(child.cmdline()):
                    return child
        raise AssertionError(f"no vLLM worker of rank {rank} under the server")


@contextlib.contextmanager
def serving(model_dir: Path, transport: str, *options: str, log: Path | None = None) -> Iterator[Served]:
    command = [sys.executable, "-m", "weightsync", "serve", "--engine", "vllm", "--model", str(model_dir)]
    command += ["--port", "0", "--ready-timeout", "1", "--transport", transport, "--vllm-args", TP2, *options]
    footprints = Footprints()
    process = ChildProcess(command, env=os.environ | ENV, log_path=log)
    try:
        line = process.wait_for_line("weightsync serve:", START_S)
        assert line is not None, process.why_not_started("weightsync serve --engine vllm -tp 2", START_S)
        found = re.match(r"weightsync serve: (\S+) receiver (\S+)", line)
        assert found is not None, line
        footprints.during(process.pid)
        served = Served(process, found.group(1), found.group(2).split(","))
        yield served
        served.http.close()
        footprints.during(process.pid)
    finally:
        process.close()
    # vLLM's all-reduce segments (vllm_dist_*), message queues (psm_*), sockets: all removed
    assert footprints.left() == (set(), set()), (footprints.shm, footprints.tmp)


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen2"]


@pytest.fixture(scope="module")
def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[int]:
    return _generate(model_dir)


@pytest.fixture(scope="module")
def qwen2_shm(model_dir: Path) -> Iterator[tuple[Served, contextlib.ExitStack]]:
    """One qwen2 server over shm for the bit-exact test over shm and the killed-worker fault after
    it, which ends it (closing the stack)."""
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(serving(model_dir, "shm")), stack


def _generate(model_dir: Path) -> list[int]:
    """transformers' greedy tokens for PROMPT from the checkpoint in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def _lands_bit_exact(served: Served, model_dir: Path) -> None:
    """Two pushes land on both workers, bit-exact, and it serves what transformers generates."""
    checkpoint = load_file(str(model_dir / "model.safetensors"))  # the MoE's: one tensor per expert
    expected = _generate(model_dir)
    info = served.http.get("/weight_info").json()
    assert info["workers"] == 2 and len(served.addresses) == 2 and info["addresses"] == served.addresses
    assert served.greedy().status_code == 503  # nothing pushed yet
    with WeightSender(served.addresses, timeout=WAIT_S, verify="bucket") as sender:
        for version, weights in ((1, {n: t * 0.5 for n, t in checkpoint.items()}), (2, checkpoint)):
            report = sender.push(weights, version)
            assert report.ok, report.failed
            assert served.http.get("/weight_info").json()["content_digest"] == source_digest(weights)
    answer = served.greedy().json()
    assert answer["weight_version"] == 2 and answer["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize(("kind", "transport"), [("qwen2", "tcp"), ("qwen3_moe", "shm")])
def test_two_workers_land_every_push_bit_exact_and_serve_what_transformers_generates(
    tiny_models: dict[str, Path], tmp_path: Path, kind: str, transport: str
) -> None:
    model_dir = tiny_models.get(kind) or tmp_path / kind
    if kind not in tiny_models:
        save_model(kind, model_dir)
    with serving(model_dir, transport, log=tmp_path / "server.log") as served:
        _lands_bit_exact(served, model_dir)
    log = (tmp_path / "server.log").read_text()  # the server's stderr, its stop included
    assert re.findall(r"sync of version (\d+) committed on 2 worker", log) == ["1", "2"], log[-4000:]
    assert "leaked shared_memory" not in log, log[-4000:]


def test_two_workers_land_every_push_over_shm_and_the_cli_says_one_line_per_server(
    qwen2_shm: tuple[Served, contextlib.ExitStack],
    model_dir: Path,
    checkpoint: dict[str, torch.Tensor],
    capsys: pytest.CaptureFixture[str],
) -> None:
    served = qwen2_shm[0]
    _lands_bit_exact(served, model_dir)
    capsys.readouterr()
    assert cli.main(["push", "--model", str(model_dir), "--to", served.url, "--timeout", str(WAIT_S)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == f"{served.url}: committed version 3" and len(out) == 2, out
    assert out[1].startswith("version 3: committed on 1 of 1 servers"), out
    sent = served.http.get("/weight_info").json()["last_sync"]["bytes"]
    assert sent <= 0.6 * sum(t.nbytes for t in checkpoint.values()), "a worker gets its boxes, read as slices"


@pytest.mark.fault(
    "vLLM TP=2: one worker process is killed (SIGKILL) in the middle of a sync",
    expected="the push fails; every later response is the previous version's or a 503 (never a mix); "
    "/health names the engine failed",
)
def test_a_worker_killed_mid_sync_leaves_the_previous_version_or_503s(
    qwen2_shm: tuple[Served, contextlib.ExitStack],
    checkpoint: dict[str, torch.Tensor],
    expected: list[int],
    observe: Any,
) -> None:
    served, stack = qwen2_shm
    with stack:  # the server ends with this test
        version = (served.http.get("/weight_info").json()["last_committed"] or 0) + 1  # versions only go forward
        with WeightSender(served.addresses, timeout=WAIT_S, bucket_bytes=1 << 16) as sender:
            assert sender.push(checkpoint, version).ok
            gate, reports, errors = threading.Event(), [], []

            def push() -> None:
                try:
                    reports.append(sender.push(_Gated({n: t * 2 for n, t in checkpoint.items()}, gate), version + 1))
                except Exception as exc:
                    errors.append(exc)

            pushing = threading.Thread(target=push)
            pushing.start()
            try:
                assert wait_until(lambda: served.http.get("/weight_info").json()["state"] == "syncing")
                served.worker(1).send_signal(signal.SIGKILL)
            finally:
                gate.set()
                pushing.join(WAIT_S * 4)
            assert not pushing.is_alive()
            assert errors or not reports[0].ok  # the push did not succeed
        answers = []
        ends = time.monotonic() + 10
        while time.monotonic() < ends:
            answer = served.greedy()
            answers.append(answer.status_code)
            assert answer.status_code == 503 or (
                answer.status_code == 200
                and answer.json()["weight_version"] == version
                and answer.json()["choices"][0]["token_ids"] == expected
            ), answer.text
            time.sleep(0.5)
        health = served.http.get("/health")
        assert health.status_code == 503 and health.json()["state"] in ("failed", "dirty")
        observe(f"push failed; later answers {sorted(set(answers))}; /health 503 {health.json()['state']!r}")


def test_two_workers_serve_a_lora_adapter_pushed_in_memory(
    model_dir: Path, checkpoint: dict[str, torch.Tensor]
) -> None:
    """Each worker holds the whole adapter; vLLM's LoRA layers take each rank's shard of it."""
    from tests.server.test_lora import greedy, peft_policy
    from weightsync import adapter_from_peft

    policy = peft_policy(model_dir, seed=1)
    tensors, adapter = adapter_from_peft(policy, "policy")
    with serving(model_dir, "shm", "--max-lora-rank", "8") as served:
        with WeightSender(served.addresses, timeout=WAIT_S, verify="bucket", raise_on_failure=True) as sender:
            sender.push(checkpoint, 1)
            sender.push(tensors, 5, adapter=adapter)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True, "model": "policy"}
        answer = served.http.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["token_ids"] == greedy(policy, PROMPT, 8)
        assert (answer["weight_version"], answer["base_version"]) == (5, 1)
        (entry,) = served.http.get("/weight_info").json()["adapters"]
        assert (entry["name"], entry["version"]) == ("policy", 5)
