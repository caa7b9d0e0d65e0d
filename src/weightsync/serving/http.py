"""The HTTP face of every rollout server: weightsync's routes and one ASGI middleware, around the
engine's own app (weightsync's OpenAI subset for transformers, vLLM's own app for vLLM).

Routes (placed before the engine's, so these answer where it has a path of the same name):

    GET  /health        200 when serving a committed, intact version; 503 with the state and why
    GET  /weight_info   version, state, last sync, receiver addresses, digest (control.weight_info)
    POST /pause?mode=   hold generation paused (wait | abort | keep) until POST /resume
    POST /resume
    GET  /metrics       Prometheus: weightsync's metrics (vLLM: its own route, which serves ours too)

The middleware (`Face`), outermost, in this order:

    auth     `Authorization: Bearer <token>` on every path but /health and /ping when the server
             has a token (--allow-unauthenticated-generation opens /v1/* as well)
    limit    a request body over --max-request-bytes gets a 413 before anything parses it
    gate     every POST that may run the model (all but tokenize, render, /pause, /resume...)
             waits up to --ready-timeout for the first committed, intact version, then gets a
             503 naming the state; once the engine is gone for good (a vLLM worker process
             killed, say), every such POST gets that 503, also one already inside the engine

Until the engine is up, `Starting` answers every request with a 503 naming the start-up state.
Every error is one shape (error_body.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import JSONResponse, Response

from weightsync.serving.body_limit import BodyLimit
from weightsync.serving.config import PAUSE_MODES, Health, ServeConfig
from weightsync.serving.control import SyncControl
from weightsync.serving.error_body import error
from weightsync.serving.stats import Served

__all__ = ["Face", "Starting", "add_routes", "gated", "health_response"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/ping"})
"""Answered without the token: liveness probes."""

UNGATED_POSTS = frozenset(
    {
        "/pause",
        "/resume",
        "/ping",
        "/tokenize",
        "/detokenize",
        "/v1/messages/count_tokens",
        "/is_scaling_elastic_ep",
        "/freeze_gc",
    }
)
"""POSTs that run no model: answered before the first sync too."""


def gated(method: str, path: str) -> bool:
    """Whether a request waits at the gate: every POST that may run the model (OpenAI,
    Anthropic, SageMaker and tokens-in/out routes alike); renders and tokenizing do not."""
    if method != "POST" or path in UNGATED_POSTS:
        return False
    return not path.endswith(("/render", "/derender"))


def health_response(now: Health, version: int | None) -> JSONResponse:
    """GET /health's answer."""
    body: dict[str, Any] = {"status": "ok" if now.ok else "unavailable", "version": version, "state": now.state}
    if not now.ok:
        body["reason"] = now.reason
    return JSONResponse(body, status_code=200 if now.ok else 503)


class Starting:
    """The ASGI app a server's port serves from the moment it listens: a 503 naming the start-up
    state (`health`) until the engine's app is ready (`app`)."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.health = Health(False, "starting", "the server is starting")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        now = self.health
        response = health_response(now, None) if scope["path"] == "/health" else error(503, now.reason, state=now.state)
        await response(scope, receive, send)


def add_routes(app: FastAPI, control: SyncControl, served: Served, metrics: Callable[[], bytes] | None) -> None:
    """weightsync's routes, placed ahead of the engine's (Starlette answers with the first match).

    Args:
        app: the engine's app.
        control: the server's sync control.
        served: what the server serves (/weight_info's static half).
        metrics: the Prometheus text /metrics answers (None: the engine's app has a /metrics route
            of its own that includes weightsync's metrics).
    """
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        return health_response(control.health(), control.version)

    @router.get("/weight_info")
    async def info() -> dict[str, Any]:
        return control.weight_info(served)

    @router.post("/pause")
    async def pause(mode: str = Query("wait"), timeout: float = Query(60.0, gt=0, le=86400)) -> JSONResponse:
        if mode not in PAUSE_MODES:
            return error(400, f"mode must be wait, abort or keep; got {mode!r}", "mode")
        parked = await control.call(control.pause("user", mode, timeout))
        return JSONResponse({"paused": True, "parked": parked, "mode": mode})

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        await control.call(control.resume("user"))
        return {"paused": bool(control.paused_by)}

    if metrics is not None:
        render = metrics

        @router.get("/metrics")
        async def prometheus() -> Response:
            return Response(render(), media_type="text/plain; version=0.0.4")

    before = list(app.router.routes)
    app.include_router(router)
    ours = [route for route in app.router.routes if route not in before]
    app.router.routes[:] = ours + before


class Face:
    """Auth, the body limit and the gate around an engine's app (the module docstring), as the
    server's `config` sets them: its token (None: an open server), whether /v1/* is admitted
    without it, the seconds a gated request waits for a servable version, the largest body.

    Args:
        app: the engine's app (with its own middleware inside).
        control: the server's sync control.
        config: the server's.
    """

    def __init__(self, app: ASGIApp, control: SyncControl, config: ServeConfig) -> None:
        self.app = BodyLimit(app, limit=config.request_limit, hint=" (weightsync serve --max-request-bytes)")
        self.control = control
        self.token = config.auth_token
        self.open_generation = config.allow_unauthenticated_generation
        self.ready_timeout = config.ready_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not self._admitted(scope, scope["path"]):
            await send({"type": "websocket.close", "code": 1008})  # before accepting: an HTTP 403
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if not self._admitted(scope, path):
            await error(401, "missing or wrong auth token (Authorization: Bearer ...)")(scope, receive, send)
            return
        if gated(method, path):
            if not await self._servable():
                now = self.control.health()
                message = (
                    now.reason if now.state == "failed" else f"not serving after {self.ready_timeout} s: {now.reason}"
                )
                await error(503, message, state=now.state)(scope, receive, send)
                return
            send = _Unavailable(scope, receive, send, self.control)
        await self.app(scope, receive, send)

    async def _servable(self) -> bool:
        control = self.control
        if control.engine.errored:
            return False
        if control.version is not None and not control.dirty:
            return True
        control.metrics.waiting_at_gate.inc()
        try:
            return bool(await control.call(control.wait_servable(self.ready_timeout)))
        finally:
            control.metrics.waiting_at_gate.dec()

    def _admitted(self, scope: Scope, path: str) -> bool:
        if self.token is None or path in OPEN_PATHS:
            return True
        if self.open_generation and path.startswith("/v1/"):
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), self.token.encode())


class _Unavailable:
    """The `send` of a gated request: a 5xx that the engine answers because it died on the way
    (a vLLM worker process killed, say) goes out as a 503 naming the state instead."""

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
            await error(503, now.reason, state=now.state)(self.scope, self.receive, self.send)
            return
        await self.send(message)
