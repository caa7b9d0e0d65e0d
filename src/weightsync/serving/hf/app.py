"""The HTTP routes of the rollout server (FastAPI). Routes only: the work is in `openai_api`
(generation) and RolloutServer (the rest).

POST /v1/completions        OpenAI completions, whole or streamed (server-sent events)
POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template), the same
GET  /v1/models             the served model and its LoRA adapters
GET  /health                200 when serving a committed, intact version; 503 with the reason
GET  /weight_info           version, state, last sync, receiver addresses
POST /pause?mode=           pause generation (wait | abort | keep) until POST /resume
POST /resume
GET  /metrics               Prometheus

Every choice and every streamed chunk says which weight version made it. Every error is vLLM's
shape (`error_body`).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from weightsync.serving.body_limit import BodyLimit
from weightsync.serving.config import PAUSE_MODES
from weightsync.serving.error_body import error
from weightsync.serving.hf.openai_api import chat_completions, completions
from weightsync.serving.hf.schemas import ChatCompletionRequest, CompletionRequest
from weightsync.serving.hf.server import RolloutServer
from weightsync.serving.hf.startup import Startup

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def bearer(token: str | None) -> Callable[[Request], None]:
    """A dependency that admits a request carrying `Authorization: Bearer <token>` (any request
    when the server has no token). /health stays open for liveness probes."""

    def check(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong auth token (Authorization: Bearer ...)")

    return check


def create_app(target: RolloutServer | Startup) -> FastAPI:
    """The FastAPI app serving `target`: a server that is up, or one starting (then every
    endpoint answers 503 naming the state until it is up)."""
    startup = target if isinstance(target, Startup) else Startup.of(target)
    config = startup.config
    control = [Depends(bearer(config.auth_token))]
    generation = [] if config.allow_unauthenticated_generation else control
    app = FastAPI(title="weightsync rollout server")
    app.add_middleware(BodyLimit, limit=config.request_limit, hint=" (weightsync serve --max-request-bytes)")
    counter = itertools.count()

    def serving() -> RolloutServer:
        server = startup.server
        if server is None:  # starting, or could not start: say which
            now = startup.health()
            raise HTTPException(503, {"message": now.reason, "state": now.state})
        return server

    ready = Depends(serving)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException too: 401, 404, 405, 503
    async def refused(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.detail, dict):  # 503 from `serving`
            detail: dict[str, str] = exc.detail
            return error(exc.status_code, detail["message"], state=detail["state"])
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, plain(exc.errors()), first_field(exc.errors()))

    @app.get("/health")
    async def health() -> JSONResponse:
        now = startup.health()
        version = startup.server.version if startup.server is not None else None
        body = {"status": "ok" if now.ok else "unavailable", "version": version, "state": now.state}
        if not now.ok:
            body["reason"] = now.reason
        return JSONResponse(body, status_code=200 if now.ok else 503)

    @app.get("/weight_info", dependencies=control)
    async def weight_info(server: RolloutServer = ready) -> dict[str, Any]:
        return server.weight_info()

    @app.get("/v1/models", dependencies=generation)
    async def models(server: RolloutServer = ready) -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "owned_by": "weightsync"}
        adapters = [
            {"id": served.adapter.name, "object": "model", "owned_by": "weightsync", "parent": config.model_name}
            | {"weight_version": served.newest.version}
            for served in server.engine.adapters()
        ]
        return {"object": "list", "data": [card | {"weight_version": server.version}, *adapters]}

    @app.post("/pause", dependencies=control)
    async def pause(
        server: RolloutServer = ready, mode: str = Query("wait"), timeout: float = Query(60.0, gt=0, le=86400)
    ) -> JSONResponse:
        if mode not in PAUSE_MODES:
            return error(400, f"mode must be wait, abort or keep; got {mode!r}", "mode")
        parked = await asyncio.to_thread(server.pause, mode, timeout)
        return JSONResponse({"paused": True, "parked": parked, "mode": mode})

    @app.post("/resume", dependencies=control)
    async def resume(server: RolloutServer = ready) -> dict[str, Any]:
        server.resume()
        return {"paused": bool(server.loop.paused_by)}

    @app.get("/metrics", dependencies=control)
    async def metrics(server: RolloutServer = ready) -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    async def answer(server: RolloutServer, work: Callable[[str], Awaitable[Response]], prefix: str) -> Response:
        try:
            response = await work(f"{prefix}-{uuid.uuid4().hex[:12]}-{next(counter)}")
        except Exception as exc:  # never a bare "Internal Server Error": say what failed, and count it
            log.exception("generation request failed")
            response = error(500, f"the server failed: {type(exc).__name__}: {exc}")
        if not isinstance(response, StreamingResponse):  # a stream counts itself when it ends
            server.metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.post("/v1/completions", dependencies=generation, response_model=None)
    async def complete(body: CompletionRequest, server: RolloutServer = ready) -> Response:
        return await answer(server, lambda request_id: completions(server, body, request_id), "cmpl")

    @app.post("/v1/chat/completions", dependencies=generation, response_model=None)
    async def chat(body: ChatCompletionRequest, server: RolloutServer = ready) -> Response:
        return await answer(server, lambda request_id: chat_completions(server, body, request_id), "chatcmpl")

    return app


def plain(errors: Sequence[Any]) -> str:
    """pydantic's validation errors as one plain message: "field: what is wrong; ...", one
    message per field (a union type reports every alternative; the first says enough)."""
    messages: dict[str, str] = {}
    for item in errors:
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        field = location[0] if location else "body"
        messages.setdefault(field, str(item.get("msg", "invalid")).removeprefix("Value error, "))
    return "; ".join(f"{field}: {message}" for field, message in messages.items()) or "invalid request"


def first_field(errors: Sequence[Any]) -> str | None:
    """The request field the first validation error is about (OpenAI's `param`), if any."""
    for item in errors:
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        if location:
            return location[0]
    return None
