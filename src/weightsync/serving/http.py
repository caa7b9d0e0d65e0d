"""weightsync's HTTP parts on top of vLLM's own app: routes, and one ASGI middleware.

Routes (placed before vLLM's, so these answer where vLLM has a path of the same name):

    GET  /health        200 when serving a committed, intact version; 503 with the state and why
    GET  /weight_info   version, state, last sync, receiver address, digest
    POST /pause?mode=   hold generation paused (wait | abort | keep) until POST /resume
    POST /resume

The middleware, outermost, in this order:

    auth     `Authorization: Bearer <token>` on every path but /health and /ping when the server
             has a token (--allow-unauthenticated-generation opens /v1/* as well)
    gate     every POST that may run the model (all but tokenize, render, /pause, /resume...)
             waits up to --ready-timeout for the first committed, intact version, then gets an
             OpenAI-style 503 naming the state; once vLLM's engine died (a worker process
             killed, say), every such POST gets that 503, also one already inside vLLM
    version  /v1/completions and /v1/chat/completions: `weight_version` (int) on the response and
             on every streamed chunk, and per choice `weight_versions` spans
             [{"version", "start", "end"}] over its output tokens once the choice ends
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import JSONResponse

from weightsync.serving.config import PAUSE_MODES
from weightsync.serving.control import SyncControl
from weightsync.serving.vllm.versions import RECORDER, Recorder

__all__ = ["WeightsyncMiddleware", "add_routes", "error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping"})
"""Answered without the token: liveness probes."""

VERSIONED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Responses that carry weight_version."""


def error(status: int, message: str, kind: str, state: str | None = None) -> JSONResponse:
    """An OpenAI-style error body; a 503 also names the server's state."""
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    if state is not None:
        body["state"] = state
    return JSONResponse(body, status_code=status)


UNGATED_POSTS = frozenset(
    {"/pause", "/resume", "/ping", "/tokenize", "/detokenize", "/v1/messages/count_tokens", "/is_scaling_elastic_ep"}
)
"""POSTs that run no model: answered before the first sync too."""


def gated(method: str, path: str) -> bool:
    """Whether a request waits at the gate: every POST that may run the model (vLLM's OpenAI,
    Anthropic, SageMaker and tokens-in/out routes alike); renders and tokenizing do not."""
    if method != "POST" or path in UNGATED_POSTS:
        return False
    return not path.endswith(("/render", "/derender"))


class WeightsyncMiddleware:
    """Auth, the gate, and weight versions on vLLM's responses (see the module docstring).

    Args:
        app: vLLM's app (with its own middleware inside).
        control: the server's sync state.
        token: the bearer token, or None for an open server.
        open_generation: admit /v1/* without the token.
        ready_timeout: seconds a generation request waits at the gate.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        control: SyncControl,
        token: str | None,
        open_generation: bool,
        ready_timeout: float,
    ) -> None:
        self.app = app
        self.control = control
        self.token = token
        self.open_generation = open_generation
        self.ready_timeout = ready_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not self._admitted(scope, scope["path"]):
            await send({"type": "websocket.close", "code": 1008})  # before accepting: an HTTP 403
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if not self._admitted(scope, path):
            response = error(401, "missing or wrong auth token (Authorization: Bearer ...)", "authentication_error")
            await response(scope, receive, send)
            return
        if gated(method, path):
            if self.control.engine.errored or not await self.control.wait_servable(self.ready_timeout):
                now = self.control.health()
                message = (
                    now.reason if now.state == "failed" else f"not serving after {self.ready_timeout} s: {now.reason}"
                )
                await error(503, message, "service_unavailable", state=now.state)(scope, receive, send)
                return
            send = _Unavailable(scope, receive, send, self.control)
        if method != "POST" or path not in VERSIONED_PATHS:
            await self.app(scope, receive, send)
            return
        recorder = Recorder()
        token = RECORDER.set(recorder)
        try:
            await self.app(scope, receive, Labeller(send, recorder, self.control))
        finally:
            RECORDER.reset(token)

    def _admitted(self, scope: Scope, path: str) -> bool:
        if self.token is None or path in OPEN_PATHS:
            return True
        if self.open_generation and path.startswith("/v1/"):
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), self.token.encode())


class _Unavailable:
    """The `send` of a gated request: a 5xx that vLLM answers because its engine died on the way
    (a worker process killed, say) goes out as weightsync's 503 naming the state instead."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, control: SyncControl) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.control = control
        self.replaced = False

    async def __call__(self, message: Message) -> None:
        if self.replaced:
            return
        if message["type"] == "http.response.start" and int(message["status"]) >= 500 and self.control.engine.errored:
            self.replaced = True
            now = self.control.health()
            await error(503, now.reason, "service_unavailable", state=now.state)(self.scope, self.receive, self.send)
            return
        await self.send(message)


class Labeller:
    """The `send` of one versioned request: adds weight versions to its JSON body or SSE chunks."""

    def __init__(self, send: Send, recorder: Recorder, control: SyncControl) -> None:
        self.send = send
        self.recorder = recorder
        self.control = control
        self.start: Message | None = None
        self.stream = False
        self.status = 200
        self.buffer = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            headers = dict(message.get("headers") or [])
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if self.stream or self.status != 200:
                await self.send(message)
            else:
                self.start = message  # sent with the body, whose length changes
            return
        if message["type"] != "http.response.body" or self.status != 200:
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
        body = self._json(self.buffer)
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


def add_routes(
    app: FastAPI,
    control: SyncControl,
    *,
    weight_info: Callable[[], dict[str, Any]],
) -> None:
    """weightsync's routes, placed ahead of vLLM's (Starlette answers with the first match)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        now = control.health()
        body: dict[str, Any] = {"status": "ok" if now.ok else "unavailable", "version": control.version}
        body["state"] = now.state
        if not now.ok:
            body["reason"] = now.reason
        return JSONResponse(body, status_code=200 if now.ok else 503)

    @router.get("/weight_info")
    async def info() -> dict[str, Any]:
        return weight_info()

    @router.post("/pause")
    async def pause(mode: str = Query("wait"), timeout: float = Query(60.0, gt=0, le=86400)) -> JSONResponse:
        if mode not in PAUSE_MODES:
            return error(400, f"mode must be wait, abort or keep; got {mode!r}", "invalid_request_error")
        parked = await control.pause("user", mode, timeout)
        return JSONResponse({"paused": True, "parked": parked, "mode": mode})

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        await control.resume("user")
        return {"paused": bool(control.paused_by)}

    before = list(app.router.routes)
    app.include_router(router)
    ours = [route for route in app.router.routes if route not in before]
    app.router.routes[:] = ours + before
