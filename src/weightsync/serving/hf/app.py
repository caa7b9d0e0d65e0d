"""The transformers engine's app: weightsync's OpenAI subset, inside the HTTP face (serving/http.py,
which adds /health, /weight_info, /pause, /resume, /metrics, auth, the body limit and the gate).

POST /v1/completions        OpenAI completions, whole or streamed (server-sent events)
POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template), the same
GET  /v1/models             the served model and its LoRA adapters

Every choice and every streamed chunk says which weight version made it.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from weightsync.serving.error_body import error
from weightsync.serving.hf.openai_api import chat_completions, completions
from weightsync.serving.hf.schemas import ChatCompletionRequest, CompletionRequest
from weightsync.serving.hf.server import RolloutServer
from weightsync.serving.http import Face, add_routes

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def create_app(server: RolloutServer) -> Face:
    """The ASGI app serving `server`: its OpenAI subset inside the HTTP face."""
    config = server.config
    app = FastAPI(title="weightsync rollout server")
    counter = itertools.count()

    @app.exception_handler(StarletteHTTPException)  # 404, 405
    async def refused(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, plain(exc.errors()), first_field(exc.errors()))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "owned_by": "weightsync"}
        adapters = [
            {"id": name, "object": "model", "owned_by": "weightsync", "parent": config.model_name}
            | {"weight_version": served.newest.version}
            for name, served in server.control.adapters.items()
        ]
        return {"object": "list", "data": [card | {"weight_version": server.version}, *adapters]}

    async def answer(work: Callable[[str], Awaitable[Response]], prefix: str) -> Response:
        try:
            response = await work(f"{prefix}-{uuid.uuid4().hex[:12]}-{next(counter)}")
        except Exception as exc:  # never a bare "Internal Server Error": say what failed, and count it
            log.exception("generation request failed")
            response = error(500, f"the server failed: {type(exc).__name__}: {exc}")
        if not isinstance(response, StreamingResponse):  # a stream counts itself when it ends
            server.metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.post("/v1/completions", response_model=None)
    async def complete(body: CompletionRequest) -> Response:
        return await answer(lambda request_id: completions(server, body, request_id), "cmpl")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest) -> Response:
        return await answer(lambda request_id: chat_completions(server, body, request_id), "chatcmpl")

    add_routes(app, server.control, server.served, metrics=server.metrics.render)
    return Face(app, server.control, config)


def plain(errors: Sequence[Any]) -> str:
    """pydantic's validation errors as one plain message: "field: what is wrong; ...", one
    message per field (a union type reports every alternative; the first says enough)."""
    messages: dict[str, str] = {}
    for item in errors:
        location = fields(item)
        field = location[0] if location else "body"
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if item.get("type") == "json_invalid":
            message = f"not valid JSON ({message}, at character {item['loc'][-1]})"
        messages.setdefault(field, message)
    return "; ".join(f"{field}: {message}" for field, message in messages.items()) or "invalid request"


def first_field(errors: Sequence[Any]) -> str | None:
    """The request field the first validation error is about (OpenAI's `param`), if any."""
    for item in errors:
        location = fields(item)
        if location:
            return location[0]
    return None


def fields(error: Any) -> list[str]:
    """The request fields a validation error is about (outermost first): none for a body that is
    not JSON at all, whose location pydantic gives as the character where parsing failed."""
    if error.get("type") == "json_invalid":
        return []
    return [str(part) for part in error.get("loc", ()) if part != "body"]
