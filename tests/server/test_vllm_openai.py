"""`weightsync serve --engine vllm` is vLLM's own OpenAI server with weightsync's parts on top,
driven here with the `openai` client: completions and chat (the tokenizer's chat template),
streamed and not, n > 1, logprobs; the gate before the first sync, bearer auth, weight_version on
every response and chunk, pushes that change what is served, an older version refused (the
previous weights serve on), and a keep-mode response that spans a sync reporting both versions.

One server process for the module (a vLLM start costs 20-30 s here), in keep mode with a token;
the tests run in file order: the gate is checked before the first push.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from tests.helpers import WAIT_S, wait_until
from weightsync import PlanError, WeightSender
from weightsync.serving.process import ChildProcess

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    # vLLM's and transformers' imports warn (deprecated APIs, future changes): not ours to fix.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

TOKEN = "vllm-openai-test-token"
START_S = 240.0
"""vLLM's start here: about 25 s alone, several times that on a loaded 2-core host."""
REQUEST_S = 120.0
"""One request's bound: a few tokens take well under a second alone; on a loaded CI host a sampled
request with logprobs once took over 30 s."""

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PROMPT = [5, 6, 7, 8]
CONTEXT = 8192
"""The test model's context, raised from 512 (rotary positions: no weight depends on it), so that
the request that spans a sync runs for seconds while the pause around the sync takes milliseconds."""
LONG = 6000
"""Tokens of the request that spans a sync."""


class Served:
    """The server process, its URL and receiver, and clients for it."""

    def __init__(self, process: ChildProcess, url: str, address: str, model_dir: Path) -> None:
        self.process = process
        self.url = url
        self.address = address
        self.model_dir = model_dir
        self.name = model_dir.name
        self.http = httpx.Client(base_url=url, timeout=WAIT_S * 3, headers={"authorization": f"Bearer {TOKEN}"})
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, timeout=REQUEST_S, max_retries=0)

    def push(self, tensors: Any, version: int) -> Any:
        with WeightSender([self.address], timeout=WAIT_S, auth_token=TOKEN, raise_on_failure=False) as sender:
            return sender.push(tensors, version)

    def greedy(self, max_tokens: int = 8) -> Any:
        return self.openai.completions.create(
            model=self.name, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True}
        )


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' Qwen2 with a chat template, and a longer context (see CONTEXT)."""
    model_dir = tmp_path_factory.mktemp("vllm-openai") / "qwen2"
    shutil.copytree(tiny_models["qwen2"], model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    model_config = model_dir / "config.json"
    model_config.write_text(json.dumps(json.loads(model_config.read_text()) | {"max_position_embeddings": CONTEXT}))
    return model_dir


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path) -> Iterator[Served]:
    with serving(model_dir, "--sync-mode", "keep") as served:
        yield served


@contextlib.contextmanager
def serving(model_dir: Path, *options: str) -> Iterator[Served]:
    """`weightsync serve --engine vllm` on `model_dir` with a token; SIGTERM must stop it with 0."""
    command = [sys.executable, "-m", "weightsync", "serve", "--engine", "vllm", "--model", str(model_dir)]
    command += ["--port", "0", "--ready-timeout", "1", "--auth-token", TOKEN, *options]
    process = ChildProcess(command)
    try:
        line = process.wait_for_line("weightsync serve:", START_S)
        assert line is not None, process.why_not_started("weightsync serve --engine vllm", START_S)
        found = re.match(r"weightsync serve: (\S+) receiver (\S+)", line)
        assert found is not None, line
        served = Served(process, found.group(1), found.group(2), model_dir)
        yield served
        served.http.close()
        process.process.terminate()
        assert process.process.wait(WAIT_S * 3) == 0  # SIGTERM is how a server stops: exit 0
    finally:
        process.close()


@pytest.fixture(scope="module")
def checkpoint(model_dir: Path) -> dict[str, Any]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture
def pushed(vllm_server: Served, checkpoint: dict[str, Any]) -> Served:
    """The server serving the checkpoint (pushed as the last committed version + 1 if nothing is
    served now)."""
    info = vllm_server.http.get("/weight_info").json()
    if info["version"] is None:
        assert vllm_server.push(checkpoint, (info["last_committed"] or 0) + 1).ok
    return vllm_server


def test_the_gate_answers_503_until_the_first_sync(vllm_server: Served) -> None:
    health = vllm_server.http.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "waiting for weights"
    with pytest.raises(openai.APIStatusError) as refused:
        vllm_server.greedy()
    assert refused.value.status_code == 503
    error = refused.value.response.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "push weights first" in error["message"]
    with pytest.raises(openai.APIStatusError) as chat_refused:
        vllm_server.openai.chat.completions.create(model=vllm_server.name, messages=[{"role": "user", "content": "a"}])
    assert chat_refused.value.status_code == 503


def test_control_and_generation_need_the_token_and_health_does_not(vllm_server: Served) -> None:
    with httpx.Client(base_url=vllm_server.url, timeout=WAIT_S) as anonymous:
        assert anonymous.get("/weight_info").status_code == 401
        assert anonymous.post("/pause").status_code == 401
        assert anonymous.get("/metrics").status_code == 401
        refused = anonymous.post("/v1/completions", json={"model": vllm_server.name, "prompt": "a"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
        assert anonymous.get("/health").status_code in (200, 503)


def test_pushed_weights_serve_what_transformers_generates(pushed: Served) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pushed.model_dir)
    with torch.no_grad():
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT) :]
    served = pushed.greedy()
    choice = served.choices[0]
    assert choice.token_ids == expected.tolist()[: len(choice.token_ids)] and len(choice.token_ids) > 0
    assert served.weight_version == choice.weight_version == 1
    assert choice.weight_versions == [{"version": 1, "start": 0, "end": len(choice.token_ids)}]


def test_completions_with_n_and_logprobs(pushed: Served) -> None:
    body = pushed.openai.completions.create(
        model=pushed.name, prompt=["ab", "cd"], max_tokens=5, temperature=1.0, seed=7, n=2, logprobs=2
    )
    assert sorted(choice.index for choice in body.choices) == [0, 1, 2, 3]
    assert body.weight_version == 1 and body.usage.completion_tokens > 0
    for choice in body.choices:
        count = len(choice.logprobs.tokens)
        assert count > 0 and len(choice.logprobs.top_logprobs) == count
        assert choice.weight_versions == [{"version": 1, "start": 0, "end": count}]


def test_streamed_completions_label_every_chunk(pushed: Served) -> None:
    chunks = list(
        pushed.openai.completions.create(
            model=pushed.name,
            prompt="ab",
            max_tokens=6,
            temperature=1.0,
            seed=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks and all(chunk.weight_version == 1 for chunk in chunks)
    assert all(c.weight_version == 1 for chunk in chunks for c in chunk.choices)
    finals = {c.index: c for chunk in chunks for c in chunk.choices if c.finish_reason is not None}
    assert sorted(finals) == [0, 1]
    for final in finals.values():
        (span,) = final.weight_versions
        assert span["version"] == 1 and span["start"] == 0 and 0 < span["end"] <= 6
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_uses_the_tokenizers_template_streamed_and_not(pushed: Served) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}]
    tokenizer = AutoTokenizer.from_pretrained(pushed.model_dir)
    templated = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    body = pushed.openai.chat.completions.create(model=pushed.name, messages=messages, max_tokens=5, temperature=0)
    choice = body.choices[0]
    assert body.usage.prompt_tokens == len(templated["input_ids"])
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert body.weight_version == choice.weight_version == 1
    assert choice.weight_versions == [{"version": 1, "start": 0, "end": body.usage.completion_tokens}]

    stream = pushed.openai.chat.completions.create(
        model=pushed.name, messages=messages, max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert all(chunk.weight_version == 1 for chunk in chunks)
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == choice.message.content
    final = [c for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
    assert len(final) == 1 and final[0].weight_versions == choice.weight_versions


def test_a_push_changes_what_is_served_and_a_bad_one_changes_nothing(
    pushed: Served, checkpoint: dict[str, Any]
) -> None:
    before = pushed.greedy()
    version = pushed.http.get("/health").json()["version"]
    scaled = {name: tensor * 3.0 for name, tensor in checkpoint.items()}
    assert pushed.push(scaled, version + 1).ok
    changed = pushed.greedy()
    assert changed.weight_version == version + 1
    assert changed.choices[0].token_ids != before.choices[0].token_ids

    bad = dict(checkpoint)
    name = next(iter(bad))
    bad[name] = bad[name][:1]  # wrong shape: refused before anything is paused or landed
    report = pushed.push(bad, version + 2)
    assert report.failed and report.failed[0].kind == "PlanError"
    assert pushed.greedy().choices[0].token_ids == changed.choices[0].token_ids

    assert pushed.push(checkpoint, version + 3).ok
    back = pushed.greedy()
    assert back.weight_version == version + 3 and back.choices[0].token_ids == before.choices[0].token_ids
    info = pushed.http.get("/weight_info").json()
    assert info["version"] == version + 3 and info["engine"] == "vllm" and info["addresses"] == [pushed.address]
    assert info["last_sync"]["ok"] is True and info["last_sync"]["version"] == version + 3
    metrics = pushed.http.get("/metrics").text
    assert f"weightsync_weight_version {float(version + 3)}" in metrics and "vllm:" in metrics


LATE_FIRST_CHUNK_S = 2.0
"""A first chunk later than this missed the window the keep test needs (the whole request takes
about 12 s here): the API process sometimes delivers a stream's first chunk seconds late (8 s
seen once at low load; not diagnosed, see the closing notes), and the pause then lands after the
request has finished. Such an attempt proves nothing either way and is run again."""


def keep_sync_mid_stream(pushed: Served, checkpoint: dict[str, Any]) -> tuple[list[Any], int, float, dict[str, Any]]:
    """One long streamed request; at its first chunk, freeze it (keep), land a sync, let it go on.
    Returns its chunks, the version before the sync, when the first chunk came, and /weight_info
    while paused."""
    old = pushed.http.get("/health").json()["version"]
    started = time.monotonic()
    stream = pushed.openai.completions.create(
        model=pushed.name,
        prompt=PROMPT,
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks: list[Any] = []
    first_s, paused_info = 0.0, {}
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 1:
            first_s = time.monotonic() - started
            assert pushed.http.post("/pause", params={"mode": "keep"}).json()["parked"]
            paused_info = pushed.http.get("/weight_info").json()
            assert pushed.push(checkpoint, old + 1).ok
            assert pushed.http.post("/resume").json()["paused"] is False
    return chunks, old, first_s, paused_info


def test_a_keep_mode_response_spanning_a_sync_reports_both_versions(pushed: Served, checkpoint: dict[str, Any]) -> None:
    for _ in range(3):
        chunks, old, first_s, paused_info = keep_sync_mid_stream(pushed, checkpoint)
        final = [c for chunk in chunks for c in chunk.choices if c.finish_reason is not None]
        assert len(final) == 1 and final[0].finish_reason == "length"
        spans = final[0].weight_versions
        if first_s < LATE_FIRST_CHUNK_S or len(spans) > 1:
            break
    assert [span["version"] for span in spans] == [old, old + 1], (
        spans,
        f"first chunk after {first_s:.3f} s",
        [chunk.weight_version for chunk in chunks][:5],
        paused_info,
        pushed.http.get("/weight_info").json(),
    )
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == LONG
    labels = [chunk.weight_version for chunk in chunks]
    assert labels[0] == old and labels[-1] == old + 1 and labels == sorted(labels)


@pytest.mark.fault(
    "vLLM's own server: a push whose source breaks after its first bucket reached vLLM",
    expected="the sender gets the error; /health 503 'dirty', requests get an OpenAI 503 (never a mix of "
    "versions); the next good push serves again",
)
def test_a_sync_that_fails_after_reaching_vllm_leaves_it_dirty_until_the_next_good_one(
    pushed: Served, checkpoint: dict[str, Any], observe: Any
) -> None:
    from tests.server.checks import _Gated

    version = pushed.http.get("/health").json()["version"]
    with WeightSender([pushed.address], timeout=WAIT_S, auth_token=TOKEN, bucket_bytes=1 << 16) as sender:
        with pytest.raises(PlanError):  # the source breaks after its first bucket reached vLLM
            sender.push(_Gated(checkpoint, broken=True), version + 1)
    health = pushed.http.get("/health")
    assert health.status_code == 503 and health.json()["state"] == "dirty"
    with pytest.raises(openai.APIStatusError) as refused:
        pushed.greedy()
    assert refused.value.status_code == 503 and refused.value.response.json()["state"] == "dirty"
    info = pushed.http.get("/weight_info").json()
    assert (info["version"], info["last_committed"]) == (None, version), info
    older = pushed.push(checkpoint, version)  # dirty, it still takes no version at or below its last
    assert not older.ok and "versions only go forward" in older.failed[0].error, older.failed
    assert pushed.http.get("/health").json()["state"] == "dirty"

    assert pushed.push(checkpoint, version + 2).ok
    assert pushed.http.get("/health").status_code == 200
    assert pushed.greedy().weight_version == version + 2
    observe(f"PlanError at the sender; dirty (503 on /health and on requests); version {version + 2} serves after")


def test_an_older_version_is_refused_and_the_previous_weights_serve(pushed: Served, checkpoint: dict[str, Any]) -> None:
    before = pushed.greedy()
    version = before.weight_version
    refused = pushed.push({name: tensor * 2 for name, tensor in checkpoint.items()}, version - 1)
    assert not refused.ok and refused.failed[0].refused, refused.failed
    assert f"version {version - 1} is not above version {version}, committed here last" in refused.failed[0].error
    after = pushed.greedy()
    assert after.weight_version == version and after.choices[0].token_ids == before.choices[0].token_ids


@pytest.mark.fault(
    "vLLM's own server, --staged: a push fails in transfer",
    expected="only the standby copy was written: the server stays ready on the previous version, "
    "serving the same tokens",
)
def test_a_staged_server_serves_during_the_transfer_and_survives_a_failed_one(
    model_dir: Path, checkpoint: dict[str, Any], observe: Any
) -> None:
    from tests.server.checks import _Gated

    with serving(model_dir, "--staged", "--sync-mode", "abort") as staged:
        assert staged.push(checkpoint, 1).ok
        first = staged.greedy()
        moved = {name: tensor * 3.0 for name, tensor in checkpoint.items()}
        with WeightSender([staged.address], timeout=WAIT_S * 3, auth_token=TOKEN, bucket_bytes=1 << 16) as sender:
            gate, reports = threading.Event(), []
            pushing = threading.Thread(target=lambda: reports.append(sender.push(_Gated(moved, gate), 2)))
            pushing.start()
            try:
                assert wait_until(lambda: staged.http.get("/weight_info").json()["state"] == "syncing")
                during = staged.greedy()  # the transfer holds nothing: version 1 serves on
                assert during.weight_version == 1 and during.choices[0].token_ids == first.choices[0].token_ids
            finally:
                gate.set()
                pushing.join(WAIT_S * 3)
            assert reports and reports[0].ok, reports
            second = staged.greedy()
            assert second.weight_version == 2 and second.choices[0].token_ids != first.choices[0].token_ids

            with pytest.raises(PlanError):  # fails in transfer: the standby copy only
                sender.push(_Gated(checkpoint, broken=True), 3)
        assert wait_until(lambda: staged.http.get("/weight_info").json()["state"] != "syncing")
        assert staged.http.get("/health").json()["state"] == "ready"
        after = staged.greedy()
        assert after.weight_version == 2 and after.choices[0].token_ids == second.choices[0].token_ids
        observe("PlanError at the sender; ready, version 2, same greedy tokens as before the failed push")


def test_a_checkpoint_loaded_server_serves_version_0_at_once_and_takes_tcp_pushes(
    model_dir: Path, checkpoint: dict[str, Any]
) -> None:
    options = ("--load-format", "auto", "--transport", "tcp", "--allow-unauthenticated-generation")
    with serving(model_dir, *options) as served, httpx.Client(base_url=served.url, timeout=WAIT_S * 3) as anonymous:
        assert served.address.startswith("tcp://127.0.0.1:")
        body = {"model": served.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        first = anonymous.post("/v1/completions", json=body)  # generation is open; control is not
        assert first.status_code == 200 and first.json()["weight_version"] == 0
        assert anonymous.get("/weight_info").status_code == 401
        assert served.push(checkpoint, 1).ok
        again = anonymous.post("/v1/completions", json=body).json()
        assert again["weight_version"] == 1
        assert again["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]  # the same weights
