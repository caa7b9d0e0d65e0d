"""Weight versions on an engine's OpenAI responses: one ASGI middleware inside the HTTP face
(http.py), the same for every engine that serves its own OpenAI routes (vLLM, SGLang).

/v1/completions and /v1/chat/completions get `weight_version` (int) on the response and on every
streamed chunk, and per choice `weight_versions` spans [{"version", "start", "end"}] over its
output tokens once the choice ends. A request run on a LoRA adapter names the adapter's version,
and the base weights' as `base_version`. Their `model` is the served model's name where the engine
says "default" (SGLang, for a request that named none), and a 404 for an unknown model names the
LoRA adapters served too (vLLM names only the base model). Their `metadata` keeps only strings, as
OpenAI's type says (SGLang adds its own spans there, a list the `openai` client warns about).

The versions come from the engine's own per-request record: its adapter wraps the engine call the
OpenAI handlers make, and notes each output's versions in the `Recorder` of the HTTP request
being served (`RECORDER`, a context variable `WeightVersionMiddleware` sets) before the handler formats it
(serving/vllm/versions.py, serving/sglang/versions.py).
"""

from __future__ import annotations

import contextvars
import itertools
import json
from typing import Any

from weightsync.serving.control import SyncControl
from weightsync.serving.http import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RECORDER", "Labeller", "Recorder", "Span", "WeightVersionMiddleware"]

Span = dict[str, int | None]
"""{"version", "start", "end"}: output tokens [start, end) of a choice came from `version`."""


class Recorder:
    """The weight versions of one HTTP request's choices, as far as generated."""

    def __init__(self) -> None:
        self.adapter_version: int | None = None
        """The version of the LoRA adapter the request runs on (held in memory by weightsync),
        else None."""
        self.newest: int | None = None
        """The version of the newest token of the request (a streamed chunk's weight_version)."""
        self.spans: dict[int, list[Span]] = {}
        """Choice i's spans, once it ended."""
        self._calls = itertools.count()

    def next_call(self) -> int:
        """The ordinal of the engine call the request makes next (vLLM: one per prompt)."""
        return next(self._calls)

    def versions(self) -> list[int]:
        """Every version that produced a token of this request, oldest first."""
        seen = {span["version"] for spans in self.spans.values() for span in spans}
        return sorted(version for version in seen if version is not None)


RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("weightsync_recorder", default=None)
"""The recorder of the HTTP request being served, None outside one."""


LABELLED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Responses that carry weight_version."""

UNNAMED = "default"
"""The model SGLang's responses name for a request that named none."""


class WeightVersionMiddleware:
    """ASGI middleware: labels the responses of `LABELLED_PATHS` with weight versions (module docstring)."""

    def __init__(self, app: ASGIApp, control: SyncControl, model: str) -> None:
        self.app = app
        self.control = control
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LABELLED_PATHS:
            await self.app(scope, receive, send)
            return
        recorder = Recorder()
        token = RECORDER.set(recorder)
        try:
            await self.app(scope, receive, Labeller(send, recorder, self.control, self.model))
        finally:
            RECORDER.reset(token)


class Labeller:
    """The `send` of one versioned request: adds weight versions to its JSON body or SSE chunks,
    and the adapters to a 404's message; `model`: the served model's name."""

    def __init__(self, send: Send, recorder: Recorder, control: SyncControl, model: str) -> None:
        self.send = send
        self.recorder = recorder
        self.control = control
        self.model = model
        self.start: Message | None = None
        self.stream = False
        self.status = 200
        self.buffer = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            headers = dict(message.get("headers") or [])
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if self.stream or self.status not in (200, 404):
                await self.send(message)
            else:
                self.start = message  # sent with the body, whose length changes
            return
        if message["type"] != "http.response.body" or self.status not in (200, 404):
            await self.send(message)
            return
        self.buffer += message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self.stream:
            events, _, self.buffer = self.buffer.rpartition(b"\n\n")
            body = b"".join(self._event(event) + b"\n\n" for event in events.split(b"\n\n")) if events else b""
            if not more and self.buffer:
                body, self.buffer = body + self.buffer, b""
            await self.send({"type": "http.response.body", "body": body, "more_body": more})
            return
        if more:
            return
        body = self._json(self.buffer) if self.status == 200 else self._not_found(self.buffer)
        assert self.start is not None
        kept = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        kept.append((b"content-length", str(len(body)).encode()))
        await self.send({**self.start, "headers": kept})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def _label(self, payload: dict[str, Any], final: bool) -> None:
        newest = self.recorder.newest if self.recorder.newest is not None else self.control.version
        adapter = self.recorder.adapter_version
        if adapter is not None:  # the version of what the request named: its LoRA adapter
            payload["base_version"], newest = newest, adapter
        payload["weight_version"] = newest
        if payload.get("model") == UNNAMED:
            payload["model"] = self.model
        if isinstance(payload.get("metadata"), dict):
            payload["metadata"] = {key: value for key, value in payload["metadata"].items() if isinstance(value, str)}
        for choice in payload.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            choice["weight_version"] = newest
            if not final and choice.get("finish_reason") is None:
                continue  # spans come with the choice's end
            spans = self.recorder.spans.get(choice.get("index", 0))
            if spans is not None and adapter is not None:  # one adapter version for the whole request
                spans = [{"version": adapter, "start": 0, "end": spans[-1]["end"]}] if spans else []
            if spans is not None:
                choice["weight_versions"] = spans
                if spans:
                    choice["weight_version"] = spans[-1]["version"]

    def _json(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        if isinstance(payload, dict) and "choices" in payload:
            self._label(payload, final=True)
            return json.dumps(payload).encode()
        return body

    def _not_found(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
            found = payload["error"]
        except (ValueError, TypeError, KeyError):
            return body
        if not isinstance(found, dict) or found.get("param") != "model":
            return body
        adapters = ", ".join(repr(name) for name in self.control.adapters) or "none"
        found["message"] = f"{str(found.get('message', '')).rstrip()} LoRA adapters served: {adapters}."
        return json.dumps(payload).encode()

    def _event(self, event: bytes) -> bytes:
        prefix = b"data: "
        if not event.startswith(prefix) or event[len(prefix) :].strip() == b"[DONE]":
            return event
        try:
            payload = json.loads(event[len(prefix) :])
        except ValueError:
            return event
        if not isinstance(payload, dict) or "error" in payload:
            return event
        self._label(payload, final=False)
        return prefix + json.dumps(payload).encode()
