"""Weight versions added to an engine's OpenAI response bodies: whole JSON bodies (length fixed up) and SSE
chunks, also when an event arrives split over several body messages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from weightsync.serving.control import SyncControl
from weightsync.serving.labels import Labeller, Recorder
from weightsync.serving.metrics import ServerMetrics


def label(messages: list[dict[str, Any]], recorder: Recorder, adapters: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(dict(message))

    control = SyncControl(None, mode="wait", drain_timeout=1.0, metrics=ServerMetrics(), version=4)
    control.adapters.update(dict.fromkeys(adapters))  # type: ignore[arg-type]  # only their names are read
    labeller = Labeller(send, recorder, control, "tiny")

    async def run() -> None:
        for message in messages:
            await labeller(message)

    asyncio.run(run())
    return sent


def test_a_json_body_gets_versions_and_a_new_length() -> None:
    recorder = Recorder()
    recorder.newest = 5
    recorder.spans = {0: [{"version": 4, "start": 0, "end": 2}, {"version": 5, "start": 2, "end": 3}]}
    body = json.dumps({"choices": [{"index": 0, "text": "abc"}]}).encode()
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"3"), (b"x", b"y")]}
    sent = label([start, {"type": "http.response.body", "body": body, "more_body": False}], recorder)
    payload = json.loads(sent[1]["body"])
    assert payload["weight_version"] == 5 and payload["choices"][0]["weight_version"] == 5
    assert payload["choices"][0]["weight_versions"] == recorder.spans[0]
    assert (b"content-length", str(len(sent[1]["body"])).encode()) in sent[0]["headers"]
    assert (b"x", b"y") in sent[0]["headers"]


def test_sse_chunks_split_across_messages_are_each_labelled() -> None:
    recorder = Recorder()
    events = [
        {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
    ]
    stream = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events) + b"data: [DONE]\n\n"
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    pieces = [stream[:10], stream[10:70], stream[70:]]
    messages = [start] + [
        {"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1}
        for i, piece in enumerate(pieces)
    ]
    recorder.spans = {0: [{"version": 4, "start": 0, "end": 2}]}
    sent = label(messages, recorder)
    out = b"".join(m.get("body", b"") for m in sent[1:]).split(b"\n\n")
    chunks = [json.loads(line[len(b"data: ") :]) for line in out if line.startswith(b"data: {")]
    assert [chunk["weight_version"] for chunk in chunks] == [4, 4]  # nothing noted yet: the served version
    assert "weight_versions" not in chunks[0]["choices"][0] and chunks[0]["choices"][0]["weight_version"] == 4
    assert chunks[1]["choices"][0]["weight_versions"] == [{"version": 4, "start": 0, "end": 2}]
    assert b"data: [DONE]" in out and sent[-1]["more_body"] is False


def test_error_answers_pass_unchanged() -> None:
    start = {"type": "http.response.start", "status": 400, "headers": []}
    body = {"type": "http.response.body", "body": b'{"error": {"message": "bad"}}', "more_body": False}
    assert label([start, body], Recorder()) == [start, body]


def test_sglang_s_unnamed_model_is_the_served_name_its_metadata_strings_and_a_404_names_the_adapters() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": []}
    spans = [{"version": "3", "start": 0, "end": 1}]  # SGLang's, in a field that OpenAI types as strings
    metadata = {"weight_version": "3", "weight_versions": spans}
    body = json.dumps({"model": "default", "metadata": metadata, "choices": [{"index": 0, "text": "a"}]}).encode()
    sent = label([start, {"type": "http.response.body", "body": body, "more_body": False}], Recorder())
    payload = json.loads(sent[1]["body"])
    assert payload["model"] == "tiny" and payload["metadata"] == {"weight_version": "3"}, payload
    vllm_s = {"message": "The model `x` does not exist. Valid aliases: tiny.", "param": "model", "code": 404}
    body = json.dumps({"error": vllm_s}).encode()
    messages = [start | {"status": 404}, {"type": "http.response.body", "body": body, "more_body": False}]
    sent = label(messages, Recorder(), adapters=("reviewer", "critic"))
    assert json.loads(sent[1]["body"])["error"]["message"] == (
        "The model `x` does not exist. Valid aliases: tiny. LoRA adapters served: 'reviewer', 'critic'."
    )
    assert (b"content-length", str(len(sent[1]["body"])).encode()) in sent[0]["headers"]


def test_every_post_that_may_run_the_model_waits_at_the_gate() -> None:
    from weightsync.serving.http import gated

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations", "/inference/v1/generate"):
        assert gated("POST", path), path
    for path in ("/tokenize", "/v1/chat/completions/render", "/pause", "/resume"):
        assert not gated("POST", path), path
    assert not gated("GET", "/v1/models")


def test_a_websocket_without_the_token_is_closed_before_vllm_sees_it(tmp_path: Path) -> None:
    from weightsync.serving.config import ServeConfig
    from weightsync.serving.http import Face

    reached, sent = [], []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "websocket.connect"}

    async def both() -> None:
        control = SyncControl(None, mode="wait", drain_timeout=1.0, metrics=ServerMetrics(), version=1)  # type: ignore[arg-type]
        (tmp_path / "config.json").write_text("{}")
        token = "t" * 16  # ServeConfig's shortest
        config = ServeConfig(model=str(tmp_path), auth_token=token, ready_timeout=0.0, max_request_bytes=1 << 20)
        face = Face(app, control, config)
        scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
        await face(scope, receive, send)
        assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
        await face(scope | {"headers": [(b"authorization", f"Bearer {token}".encode())]}, receive, send)
        assert reached == ["/v1/realtime"]

    asyncio.run(both())
