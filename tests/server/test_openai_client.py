"""The rollout server through the official `openai` client: completions and chat, whole and
streamed, n > 1, logprobs, usage, the gate, errors, and the weight version of every response,
choice and chunk.

Every test takes the `engine` fixture: the engines these tests run on (hf here; another engine
is one more param of `engine`, with its skip marks).
"""

from __future__ import annotations

import itertools
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from tests.helpers import WAIT_S, wait_until
from tests.models import CHAT_TEMPLATE, save_tokenizer
from tests.server.conftest import LiveServer, live_server
from weightsync import ConfigError, WeightSender
from weightsync.serving.config import ServeConfig
from weightsync.serving.hf import server as runtime
from weightsync.serving.hf.engine import HFEngine

openai = pytest.importorskip("openai")

ENGINES = ["hf"]
MODEL = "qwen2"
"""The served model's name: its directory's."""
SAMPLING: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0, "seed": 11}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
RENDERED = "system: be brief\nuser: hi\nassistant: "
"""MESSAGES through tests.models.CHAT_TEMPLATE."""


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def served(tiny_models: dict[str, Path], engine: str) -> Iterator[LiveServer]:
    """A server on dummy weights that version 1 was pushed to."""
    model = tiny_models["qwen2"]
    with live_server(model, engine=engine) as server, WeightSender([server.address], timeout=WAIT_S) as sender:
        assert sender.push(load_file(model / "model.safetensors"), 1).ok
        yield server


def client_for(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S * 3)


@pytest.fixture(scope="module")
def client(served: LiveServer) -> Iterator[Any]:
    with client_for(served) as client:
        yield client


def one_span(choice: Any, version: int = 1) -> None:
    """The choice carries `version` and one span over all its tokens."""
    extra = choice.model_extra
    assert extra["weight_version"] == version
    assert extra["weight_versions"] == [{"version": version, "start": 0, "end": len(extra["token_ids"])}]


# --- completions ------------------------------------------------------------------------------------


def test_completions_n_logprobs_usage_and_versions(client) -> None:
    prompts = ["ab", "cdef"]
    resp = client.completions.create(model=MODEL, prompt=prompts, n=2, logprobs=2, **SAMPLING)
    assert resp.object == "text_completion" and len(resp.choices) == 4
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.model_extra["weight_version"] == 1
    for choice in resp.choices:
        one_span(choice)
        tokens = choice.model_extra["token_ids"]
        assert 1 <= len(tokens) <= SAMPLING["max_tokens"]
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) == len(tokens)
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
        assert choice.finish_reason in ("stop", "length")
    # each prompt once, as vLLM counts it (2 + 4 characters), whatever n; every choice's tokens
    assert resp.usage.prompt_tokens == 6
    assert resp.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in resp.choices)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.choices[0].model_extra["token_ids"] != resp.choices[1].model_extra["token_ids"], "n samples differ"


def test_streamed_completions_equal_whole_ones(client) -> None:
    prompts = ["ab", "cdef"]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, logprobs=1, **SAMPLING)
    stream = client.completions.create(
        model=MODEL, prompt=prompts, n=2, logprobs=1, stream=True, stream_options={"include_usage": True}, **SAMPLING
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" and c.model_extra["weight_version"] == 1 for c in chunks)
    *deltas, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None and len(c.choices) == 1 for c in deltas)
    for whole_choice in whole.choices:
        mine = [c.choices[0] for c in deltas if c.choices[0].index == whole_choice.index]
        assert "".join(c.text for c in mine) == whole_choice.text
        assert sum((c.model_extra["token_ids"] for c in mine), []) == whole_choice.model_extra["token_ids"]
        assert sum((c.logprobs.tokens for c in mine), []) == whole_choice.logprobs.tokens
        assert sum((c.logprobs.text_offset for c in mine), []) == whole_choice.logprobs.text_offset
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [whole_choice.finish_reason]
        assert all(c.model_extra["weight_version"] == 1 for c in mine)
        assert mine[-1].model_extra["weight_versions"] == whole_choice.model_extra["weight_versions"]


def test_a_streamed_stop_string_cuts_the_text_as_a_whole_response_does(client) -> None:
    """Text that might begin a stop string is held back mid-stream, then dropped if it does."""
    sampling = SAMPLING | {"max_tokens": 32, "seed": 7}
    text = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], **sampling).choices[0].text
    assert len(text) >= 6, f"the model generated too little text to cut: {text!r}"
    stop = text[3:6]
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], stop=[stop], **sampling).choices[0]
    assert (whole.text, whole.finish_reason) == (text[: text.find(stop)], "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], stop=[stop], stream=True, **sampling))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_stream_is_server_sent_events_ending_in_done(served) -> None:
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=WAIT_S) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    *chunks, last, done = events
    assert done == "data: [DONE]" and '"finish_reason":null' not in last and '"weight_versions":' in last
    assert all('"finish_reason":null' in chunk and '"weight_versions"' not in chunk for chunk in chunks)
    assert all('"object":"text_completion"' in chunk and '"weight_version":1' in chunk for chunk in events[:-1])


# --- chat -------------------------------------------------------------------------------------------


def test_chat_n_logprobs_usage_and_versions(client, served) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, logprobs=True, top_logprobs=2, **SAMPLING
    )
    assert resp.object == "chat.completion" and len(resp.choices) == 2
    assert resp.model_extra["weight_version"] == 1
    tokenizer = served.server.tokenizer
    assert resp.usage.prompt_tokens == len(tokenizer.encode(RENDERED, add_special_tokens=False))  # once, for n=2
    assert resp.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in resp.choices)
    for choice in resp.choices:
        one_span(choice)
        tokens = choice.model_extra["token_ids"]
        assert choice.message.role == "assistant"
        assert choice.message.content == tokenizer.decode(tokens, skip_special_tokens=True)
        assert [entry.token for entry in choice.logprobs.content] == [tokenizer.decode([t]) for t in tokens]
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_chat_is_the_completion_of_its_rendered_prompt(client) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    completion = client.completions.create(model=MODEL, prompt=RENDERED, max_tokens=8, temperature=0)
    assert chat.choices[0].model_extra["token_ids"] == completion.choices[0].model_extra["token_ids"]
    assert chat.usage == completion.usage


def test_streamed_chat_equals_whole_chat(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, **SAMPLING)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True}, **SAMPLING
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.model_extra["weight_version"] == 1 for c in chunks)
    *deltas, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    for whole_choice in whole.choices:
        mine = [c.choices[0] for c in deltas if c.choices[0].index == whole_choice.index]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == whole_choice.message.content
        assert mine[-1].finish_reason == whole_choice.finish_reason
        assert mine[-1].model_extra["weight_versions"] == whole_choice.model_extra["weight_versions"]


def test_max_completion_tokens_bounds_a_chat(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, max_tokens=9, temperature=0
    )
    assert len(resp.choices[0].model_extra["token_ids"]) <= 3


# --- errors -----------------------------------------------------------------------------------------


def error_of(raised: pytest.ExceptionInfo[Any], status: int, kind: str) -> dict[str, Any]:
    """The error object, checked to be vLLM's shape: message, type, param, code."""
    assert raised.value.status_code == status
    body = raised.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert (body["type"], body["code"]) == (kind, status)
    assert "Traceback" not in body["message"] and "object at 0x" not in body["message"]
    return dict(body)


@pytest.mark.parametrize("stream", [False, True])
def test_requests_before_the_first_sync_get_a_503(tiny_models, engine, stream) -> None:
    with live_server(tiny_models["qwen2"], engine=engine, ready_timeout=0.2) as server, client_for(server) as client:
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model=MODEL, prompt="ab", max_tokens=2, stream=stream)
        assert "not serving after 0.2 s" in error_of(raised, 503, "ServiceUnavailableError")["message"]
        assert raised.value.response.json()["state"] == "waiting for weights"
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream)
        error_of(raised, 503, "ServiceUnavailableError")


def test_the_client_with_its_default_retries_reports_the_gate_after_two_retry_afters(tiny_models, engine) -> None:
    """Every 503 of the gate carries Retry-After, which the official client waits out between its
    default two retries: it reports after 3 waits at the gate and 2 Retry-Afters, no more."""
    from weightsync.serving.error_body import RETRY_AFTER_S

    gate_s = 0.2
    with live_server(tiny_models["qwen2"], engine=engine, ready_timeout=gate_s) as server:
        raw = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "ab"}, timeout=WAIT_S)
        assert raw.status_code == 503 and raw.headers["retry-after"] == str(RETRY_AFTER_S), raw.headers
        assert "push weights first" in raw.json()["error"]["message"] and raw.json()["state"] == "waiting for weights"
        tries: list[float] = []
        hooks = {"request": [lambda request: tries.append(time.monotonic())]}
        with (
            httpx.Client(event_hooks=hooks) as http,
            openai.OpenAI(  # max_retries: its default, 2
                base_url=f"{server.url}/v1", api_key="unused", http_client=http
            ) as client,
        ):
            with pytest.raises(openai.APIStatusError) as raised:
                client.completions.create(model=MODEL, prompt="ab", max_tokens=2)
    assert raised.value.status_code == 503 and len(tries) == 3, tries
    # each retry waited Retry-After (its own backoff would be 0.5 s, then 1 s)
    assert all(later - earlier >= RETRY_AFTER_S for earlier, later in itertools.pairwise(tries)), tries
    assert ServeConfig.__dataclass_fields__["ready_timeout"].default * 3 + 2 * RETRY_AFTER_S < 35


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_vllm_shaped_errors(client, stream) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="ab", max_tokens=600, stream=stream)
    assert "max_model_len 512" in error_of(raised, 400, "BadRequestError")["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}], stream=stream)
    assert error_of(raised, 400, "BadRequestError")["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="another", messages=MESSAGES, stream=stream)
    assert error_of(raised, 404, "NotFoundError")["param"] == "model"


@pytest.mark.parametrize("tokenizer", ["no chat template", "no tokenizer"])
def test_chat_without_a_chat_template_is_a_clear_400(tiny_models, tmp_path, engine, tokenizer) -> None:
    model = tmp_path / MODEL
    shutil.copytree(tiny_models["qwen2"], model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    if tokenizer == "no chat template":
        save_tokenizer(model, chat_template=None)
    with live_server(model, engine=engine, load_format="auto") as server, client_for(server) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        message = error_of(raised, 400, "BadRequestError")["message"]
        assert ("no chat template" if tokenizer == "no chat template" else "has no tokenizer") in message
        assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).model_extra["weight_version"] == 0


def test_a_chat_template_file_serves_chat_for_a_model_without_one(tiny_models, tmp_path, engine, caplog) -> None:
    model = tmp_path / MODEL
    shutil.copytree(tiny_models["qwen2"], model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    save_tokenizer(model, chat_template=None)
    with caplog.at_level(logging.WARNING, logger="weightsync"), live_server(model, engine=engine, load_format="auto"):
        pass
    named = [r.getMessage() for r in caplog.records if "has no chat template" in r.getMessage()]
    assert named == [
        f"{model}: the tokenizer has no chat template: /v1/chat/completions answers 400 (give --chat-template FILE)"
    ]
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    with (
        live_server(model, engine=engine, load_format="auto", chat_template=str(template)) as server,
        client_for(server) as client,
    ):
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
        assert answer.choices[0].message.role == "assistant" and answer.model_extra["weight_version"] == 0
    with pytest.raises(ConfigError, match="is not a file"):
        ServeConfig(model=str(model), chat_template=str(tmp_path / "missing.jinja"))


class FailingEngine(HFEngine):
    """The hf engine, whose steps raise once `fail_after` more steps have run."""

    fail_after: int | None = None

    def step(self) -> list[Any]:
        if self.fail_after is not None:
            if self.fail_after == 0:
                raise RuntimeError("injected mid-stream failure")
            self.fail_after -= 1
        return super().step()


@pytest.mark.fault(
    "engine failure mid-stream: the engine raises after a streamed request sent chunks",
    expected="the stream ends with one OpenAI error event then `data: [DONE]` (the openai client raises "
    "APIError while iterating); counted as a 500 in /metrics; the next request is served",
)
def test_an_engine_failure_mid_stream_is_an_error_event_then_the_end(tiny_models, monkeypatch, observe) -> None:
    def build(config: ServeConfig) -> FailingEngine:
        return FailingEngine(config.model, load_format=config.load_format)

    monkeypatch.setattr(runtime, "build_engine", build)
    with live_server(tiny_models["qwen2"], load_format="auto") as server, client_for(server) as client:
        server.server.engine.fail_after = 3  # type: ignore[attr-defined]
        stream = client.completions.create(model=MODEL, prompt="ab", max_tokens=20, temperature=0, stream=True)
        received = []
        with pytest.raises(openai.APIError) as raised:
            for chunk in stream:
                received.append(chunk)
        assert len(received) == 3, "three good steps streamed, then the error"
        assert raised.value.body["code"] == 500 and raised.value.body["type"] == "InternalServerError"
        assert raised.value.body["message"] == "the engine failed: injected mid-stream failure"
        body = {"prompt": "ab", "max_tokens": 20, "temperature": 0, "stream": True}
        server.server.engine.fail_after = 2  # type: ignore[attr-defined]
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as response:
            events = [line for line in response.iter_lines() if line]
        assert response.status_code == 200 and events[-1] == "data: [DONE]"
        assert events[-2].startswith('data: {"error":') and len(events) == 4
        server.server.engine.fail_after = None  # type: ignore[attr-defined]
        assert 'weightsync_requests_total{status="500"} 2.0' in server.client.metrics()
        # greedy, as the streams above, which went past 2 tokens: sampling may end the text at once
        after = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, temperature=0)
        assert after.choices[0].finish_reason == "length"
        observe(
            f"3 chunks, then `{events[-2][len('data: ') :]}`, then [DONE]; openai raised APIError; "
            "counted as 500; the next request was served"
        )


# --- versions across a keep-mode sync ---------------------------------------------------------------


class Hold:
    """Wraps an engine's `step`: once armed with `after`, that many steps run, then the next one
    waits for `release` (the loop is then mid-step, as a sync or pause would find it)."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.after: int | None = None
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> Any:
        if self.after is not None:
            if self.after == 0:
                self.after = None
                self.reached.set()
                assert self.release.wait(WAIT_S)
            else:
                self.after -= 1
        return self.step()


def test_a_stream_spanning_a_keep_sync_reports_each_version_where_it_began(tiny_models, engine) -> None:
    """Frozen mid-stream by a keep pause after exactly 4 tokens, a sync lands, generation goes on:
    each chunk carries the version of its tokens, and the last one's spans say 0-4 on version 1,
    the rest on version 2."""
    model = tiny_models["qwen2"]
    v1 = load_file(model / "model.safetensors")
    with (
        live_server(model, engine=engine, sync_mode="keep") as server,
        WeightSender([server.address], timeout=WAIT_S) as sender,
        client_for(server) as client,
    ):
        assert sender.push(v1, 1).ok
        hold = Hold(server.server.engine.step)
        server.server.engine.step = hold  # type: ignore[method-assign]
        chunks: list[Any] = []

        def read() -> None:
            for chunk in client.completions.create(
                model=MODEL, prompt=[3, 4], max_tokens=40, temperature=0, stream=True
            ):
                chunks.append(chunk)

        hold.after = 3  # three steps, then the fourth waits: we pause while it runs
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert hold.reached.wait(WAIT_S)
        paused: list[dict[str, Any]] = []
        pauser = threading.Thread(target=lambda: paused.append(server.client.pause("keep")), daemon=True)
        pauser.start()
        assert wait_until(lambda: server.client.weight_info()["paused_by"] == {"user": "keep"})
        hold.release.set()  # the fourth step ends, on version 1; then the loop parks
        pauser.join(WAIT_S)
        assert paused and paused[0]["parked"]
        assert sender.push({name: t * 1.5 for name, t in v1.items()}, 2).ok  # lands while frozen
        server.client.resume()
        reader.join(WAIT_S * 3)
        assert not reader.is_alive()
    versions = [c.choices[0].model_extra["weight_version"] for c in chunks]
    tokens = [c.choices[0].model_extra["token_ids"] for c in chunks]
    total = sum(len(t) for t in tokens)
    assert total > 4, "the model ended the completion before the sync: pick another prompt"
    assert sum(len(t) for t, v in zip(tokens, versions, strict=True) if v == 1) == 4
    assert versions == sorted(versions) and set(versions) == {1, 2}
    assert chunks[-1].choices[0].model_extra["weight_versions"] == [
        {"version": 1, "start": 0, "end": 4},
        {"version": 2, "start": 4, "end": total},
    ]
    assert [c.model_extra["weight_version"] for c in chunks] == versions


def test_a_bug_of_ours_mid_stream_is_an_error_event_too(client, monkeypatch) -> None:
    from weightsync.serving.hf.formats import CompletionFormat

    written = CompletionFormat.stream_choice
    calls = []

    def fails_on_the_second(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("injected")
        return written(self, *args, **kwargs)

    monkeypatch.setattr(CompletionFormat, "stream_choice", fails_on_the_second)
    stream = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=8, temperature=0, stream=True)
    with pytest.raises(openai.APIError) as raised:
        list(stream)
    assert raised.value.body == {
        "message": "the server failed: KeyError: 'injected'",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
