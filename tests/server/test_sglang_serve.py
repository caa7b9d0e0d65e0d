"""`weightsync serve --engine sglang` on real SGLang (0.5.23, its own venv: scripts/install-sglang.sh):
SGLang's own server and routes, weightsync's receiver in its TP worker, the sync control on top.

Two servers for the module, started side by side (an SGLang start costs a minute here): one on
dummy weights with a token, which the tests push into, and one started on checkpoint 1 itself
(`--load-format auto`), the reference. The tests run in file order: the gate is checked before
the first push. Checked:

- the gate answers 503 until the first push; the token guards generation and control, not /health;
  SGLang's own weight, label and pause routes are refused (weightsync owns the weights);
- a push of checkpoint 1 serves exactly what the server started on checkpoint 1 serves (greedy);
- the official `openai` client: completions (n > 1) and chat, streamed and not, with
  `weight_version` on every response, chunk and choice, and spans once a choice ends;
- a push that fails (a tensor missing) is refused and the previous version serves on; so is a
  push of an older version (versions only go forward);
- under load (clients generating while checkpoints 0 and 1 are pushed back to back), every
  response's greedy output is that of the checkpoint its version names;
- SIGTERM stops the server with status 0; SIGKILL to the other server (as the OOM killer sends
  it) takes SGLang's processes and shared memory with it within 30 s (the server's watchdog).

Skipped where SGLang's venv is absent (WEIGHTSYNC_SKIP_SGLANG=1 skips installing it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from tests.helpers import WAIT_S, RowShards, push_from_ranks, wait_until
from tests.leftovers import Footprints, running, tree
from tests.models import save_model
from weightsync import SyncFailed, WeightSender
from weightsync.digest import source_digest
from weightsync.serving.process import ChildProcess
from weightsync_bench.sglang_server import sglang_venv

openai = pytest.importorskip("openai")

VENV = sglang_venv()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
    pytest.mark.skipif(VENV is None, reason="SGLang's venv is absent (scripts/install-sglang.sh makes it)"),
]

TOKEN = "sglang-serve-test-token"
START_S = 420.0
"""SGLang's start here: about a minute alone, several times that on a loaded 2-core host."""

PROMPTS = [[10, 20, 30, 40], [5, 6, 7], [99, 3]]
NEW_TOKENS = 8
KILLED_GONE_S = 30.0


class Served:
    """One `weightsync serve --engine sglang` process, its URL and receiver, and clients for it."""

    def __init__(self, process: ChildProcess, url: str, address: str, name: str) -> None:
        self.process = process
        self.url = url
        self.address = address
        self.name = name
        self.http = httpx.Client(base_url=url, timeout=WAIT_S * 3, headers={"authorization": f"Bearer {TOKEN}"})
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, timeout=WAIT_S * 3, max_retries=0)

    def close(self) -> None:
        """Its clients' connections (left to the garbage collector, they warn in a later test)."""
        self.http.close()
        self.openai.close()

    def push(self, tensors: dict[str, Any], version: int) -> Any:
        with WeightSender([self.address], timeout=WAIT_S, auth_token=TOKEN, raise_on_failure=False) as sender:
            return sender.push(tensors, version)

    def greedy(self, prompt: list[int]) -> tuple[list[int], Any]:
        """SGLang's native /generate, greedy: the output tokens and the response's meta_info."""
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
        answer = self.http.post("/generate", json=body)
        answer.raise_for_status()
        return list(answer.json()["output_ids"]), answer.json()["meta_info"]

    def version(self) -> int | None:
        return self.http.get("/health").json()["version"]


@contextlib.contextmanager
def _started(model_dir: Path, log: Path, *options: str) -> Iterator[ChildProcess]:
    assert VENV is not None
    command = [str(VENV / "bin" / "python"), "-m", "weightsync", "serve", "--engine", "sglang"]
    command += ["--model", str(model_dir), "--port", "0", "--ready-timeout", "1", "--auth-token", TOKEN, *options]
    command += ["--engine-args", "--dtype float32"]
    process = ChildProcess(command, log_path=log)
    try:
        yield process
    finally:
        process.close()


def _announced(process: ChildProcess, name: str) -> Served:
    line = process.wait_for_line("weightsync serve:", START_S)
    assert line is not None, process.why_not_started("weightsync serve --engine sglang", START_S)
    found = re.match(r"weightsync serve: (\S+) receiver (\S+)", line)
    assert found is not None, line
    return Served(process, found.group(1), found.group(2), name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    paths = [tmp_path_factory.mktemp(f"sglang_serve_seed{seed}") / "qwen2" for seed in (0, 1)]
    for seed, path in enumerate(paths):
        save_model("qwen2", path, seed=seed)
    return paths


@pytest.fixture(scope="module")
def weights(checkpoints: list[Path]) -> list[dict[str, Any]]:
    return [load_file(str(path / "model.safetensors")) for path in checkpoints]


@pytest.fixture(scope="module")
def servers(checkpoints: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, Served]]:
    """(the server on dummy weights, the server started on checkpoint 1), started side by side;
    SIGTERM must stop each that still runs with 0."""
    logs = tmp_path_factory.mktemp("sglang_serve_logs")
    FOOTPRINTS.clear()
    FOOTPRINTS.append(Footprints())  # before either server makes anything
    with (
        _started(checkpoints[0], logs / "dummy.log", "--load-format", "dummy") as dummy_process,
        _started(checkpoints[1], logs / "auto.log", "--load-format", "auto") as auto_process,
    ):
        dummy = _announced(dummy_process, checkpoints[0].name)
        reference = _announced(auto_process, checkpoints[1].name)
        try:
            yield dummy, reference
        finally:
            dummy.close()
            reference.close()
        running = [served for served in (dummy, reference) if served.process.alive()]
        for served in running:
            served.process.process.terminate()
        for served in running:
            assert served.process.process.wait(WAIT_S * 3) == 0  # SIGTERM is how a server stops: exit 0


FOOTPRINTS: list[Footprints] = []
"""What /dev/shm and the temporary folder held before the module's servers started."""


@pytest.fixture(scope="module")
def dummy(servers: tuple[Served, Served]) -> Served:
    return servers[0]


@pytest.fixture(scope="module")
def expected(servers: tuple[Served, Served]) -> list[list[int]]:
    """Greedy output of checkpoint 1 on every prompt, from the server SGLang loaded it into."""
    reference = servers[1]
    assert reference.version() == 0, "a server started on a checkpoint serves it as version 0"
    return [reference.greedy(prompt)[0] for prompt in PROMPTS]


def test_the_gate_answers_503_until_the_first_push(dummy: Served) -> None:
    health = dummy.http.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "waiting for weights"
    with pytest.raises(openai.APIStatusError) as refused:
        dummy.openai.completions.create(model=dummy.name, prompt=PROMPTS[0], max_tokens=4)
    assert refused.value.status_code == 503
    assert "push weights first" in refused.value.response.json()["error"]["message"]
    info = dummy.http.get("/weight_info").json()
    assert info["engine"] == "sglang" and info["workers"] == 1 and info["version"] is None


def test_the_token_guards_generation_and_control_not_health(dummy: Served) -> None:
    with httpx.Client(base_url=dummy.url, timeout=WAIT_S) as anonymous:
        assert anonymous.get("/weight_info").status_code == 401
        assert anonymous.post("/pause").status_code == 401
        assert anonymous.post("/generate", json={"input_ids": [1]}).status_code == 401
        refused = anonymous.post("/v1/completions", json={"model": dummy.name, "prompt": "a"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
        assert anonymous.get("/health").status_code == 503


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/update_weights_from_disk", {"model_path": "/tmp"}),
        ("/update_weight_version", {"new_version": "7"}),
        ("/pause_generation", {"mode": "abort"}),
        ("/begin_weight_update", {}),
    ],
)
def test_sglangs_own_weight_routes_are_refused(dummy: Served, path: str, body: dict[str, Any]) -> None:
    answer = dummy.http.post(path, json=body)
    assert answer.status_code == 403 and "weightsync owns this server's weights" in answer.json()["error"]["message"]


def test_a_push_serves_what_sglang_serves_from_the_checkpoint(
    dummy: Served, weights: list[dict[str, Any]], expected: list[list[int]]
) -> None:
    report = dummy.push(weights[1], 1)
    assert report.ok, report.summary()
    assert dummy.version() == 1
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        output, meta = dummy.greedy(prompt)
        assert output == tokens and len(output) == NEW_TOKENS
        assert meta["weight_version"] == "1"
    info = dummy.http.get("/weight_info").json()
    assert info["version"] == 1 and info["state"] == "ready" and info["last_sync"]["ok"] is True


def test_openai_completions_carry_versions_on_every_choice(dummy: Served) -> None:
    body = dummy.openai.completions.create(model=dummy.name, prompt=["ab", "cd"], max_tokens=5, temperature=1.0, n=2)
    assert sorted(choice.index for choice in body.choices) == [0, 1, 2, 3]
    assert body.weight_version == 1
    for choice in body.choices:
        assert choice.weight_version == 1
        (span,) = choice.weight_versions
        assert span["version"] == 1 and span["start"] == 0 and span["end"] > 0


def test_openai_streams_label_every_chunk(dummy: Served) -> None:
    chunks = list(dummy.openai.completions.create(model=dummy.name, prompt="ab", max_tokens=6, stream=True))
    assert chunks and all(chunk.weight_version == 1 for chunk in chunks)
    finals = [c for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
    assert finals and finals[-1].weight_versions[-1]["version"] == 1
    chat = dummy.openai.chat.completions.create(
        model=dummy.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.weight_version == 1 and chat.choices[0].weight_version == 1
    streamed = list(
        dummy.openai.chat.completions.create(
            model=dummy.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    )
    assert streamed and all(chunk.weight_version == 1 for chunk in streamed)


def test_a_push_missing_a_tensor_is_refused_and_the_previous_version_serves(
    dummy: Served, weights: list[dict[str, Any]], expected: list[list[int]]
) -> None:
    partial = dict(weights[0])
    partial.pop(next(iter(partial)))
    with WeightSender([dummy.address], timeout=WAIT_S, auth_token=TOKEN) as sender, pytest.raises(SyncFailed) as failed:
        sender.push(partial, 2)
    assert "PlanError" in str(failed.value) and "plan lacks" in str(failed.value)
    assert dummy.version() == 1
    assert dummy.greedy(PROMPTS[0])[0] == expected[0]


def test_an_older_version_is_refused_and_the_previous_version_serves(
    dummy: Served, weights: list[dict[str, Any]], expected: list[list[int]]
) -> None:
    """Versions only go forward (docs/failure-semantics.md): other weights under version 1 (the
    one serving) or 0 are refused before a byte moves, and version 1 serves on, unchanged."""
    for version in (1, 0):
        report = dummy.push(weights[0], version)
        assert not report.ok and report.failed[0].refused, report.failed
        assert f"version {version} is not above version 1, committed here last" in report.failed[0].error
    info = dummy.http.get("/weight_info").json()
    assert (info["version"], info["last_committed"]) == (1, 1), info
    assert dummy.greedy(PROMPTS[0])[0] == expected[0]


def test_under_load_every_response_is_the_checkpoint_its_version_names(
    dummy: Served, weights: list[dict[str, Any]], expected: list[list[int]]
) -> None:
    assert dummy.push(weights[0], 2).ok
    outputs = {0: dummy.greedy(PROMPTS[0])[0], 1: expected[0]}  # by checkpoint
    assert outputs[0] != outputs[1], "the two checkpoints must generate differently"
    seen: list[tuple[list[int], Any]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def client() -> None:
        try:
            while not stop.is_set():
                seen.append(dummy.greedy(PROMPTS[0]))
        except BaseException as exc:  # the test fails below with it
            errors.append(exc)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for version in range(3, 9):  # odd versions: checkpoint 1, even: checkpoint 0
            report = dummy.push(weights[version % 2], version)
            assert report.ok, report.summary()
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert not errors, errors
    checked = 0
    for output, meta in seen:
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"], "start": 0, "end": len(output)}]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == len(output)
        if len(spans) == 1:  # one version made it all: it must be that checkpoint's output
            assert output == outputs[int(spans[0]["version"]) % 2], (spans, output)
            checked += 1
    assert checked >= len(seen) // 2 and checked > 0
    assert dummy.version() == 8


def test_two_trainer_ranks_push_their_rows_and_the_server_holds_the_whole_versions_digest(
    dummy: Served, weights: list[dict[str, Any]], expected: list[list[int]]
) -> None:
    """A sharded push (each rank of a 2-rank trainer sends the rows it holds, neither gathers a
    tensor) into SGLang's TP worker: the worker commits once both parts landed, serves what
    SGLang serves from the checkpoint, and holds the content digest of the checkpoint pushed
    whole."""
    ranks = [RowShards(weights[1], rank, 2) for rank in range(2)]
    reports = push_from_ranks([dummy.address], ranks, 9, timeout=WAIT_S * 3, auth_token=TOKEN, verify="bucket")
    assert all(report.ok for report in reports), [report.summary() for report in reports]
    assert all(0 < report.wire_bytes < sum(t.nbytes for t in weights[1].values()) for report in reports)
    assert dummy.version() == 9
    for prompt, tokens in zip(PROMPTS, expected, strict=True):
        assert dummy.greedy(prompt)[0] == tokens
    assert dummy.http.get("/weight_info").json()["content_digest"] == source_digest(weights[1])


def test_sigkill_takes_sglangs_processes_and_shared_memory_with_it(servers: tuple[Served, Served]) -> None:
    """SIGKILL gives the server no way out: its watchdog (serving/watchdog.py) ends SGLang's
    scheduler and detokenizer and removes what they made. (Last: it kills the reference.)"""
    reference = servers[1]
    footprints = FOOTPRINTS[0]
    pid = reference.process.pid
    footprints.during(pid)
    processes = [child for child in tree(pid) if child != pid]
    assert len(processes) >= 3, "the watchdog, SGLang's scheduler and detokenizer"
    os.kill(pid, signal.SIGKILL)  # the server alone: not its group, as the OOM killer does
    reference.process.process.wait(WAIT_S)
    assert wait_until(lambda: not running(processes), timeout=KILLED_GONE_S), running(processes)
    assert wait_until(lambda: not footprints.left()[0], timeout=KILLED_GONE_S), footprints.left()
