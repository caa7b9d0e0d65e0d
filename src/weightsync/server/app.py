"""The HTTP routes of the rollout server (FastAPI). Routes only: the work is in RolloutServer.

POST /v1/completions   OpenAI completions; every choice says which weight version made it
GET  /v1/models        the served model
GET  /health           200 when serving a committed, intact version; 503 with the reason
GET  /weight_info      version, state, last sync, receiver addresses
POST /pause?mode=      pause generation (wait | abort | keep) until POST /resume
POST /resume
GET  /metrics          Prometheus
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from weightsync.engines.base import SamplingParams
from weightsync.errors import RequestError
from weightsync.server.body_limit import BodyLimit
from weightsync.server.loop import PAUSE_MODES, TokenEvent
from weightsync.server.runtime import RolloutServer
from weightsync.server.schemas import Choice, CompletionRequest, CompletionResponse, Logprobs, Usage
from weightsync.server.startup import Startup

__all__ = ["create_app"]

GATE_POLL_S = 0.02

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}
"""OpenAI-style error types by HTTP status; anything else is a "server_error"."""

log = logging.getLogger(__name__)


def error(status: int, message: str, kind: str, state: str | None = None) -> JSONResponse:
    """An OpenAI-style error body (plain message, type, code); a 503 also names the server's state."""
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    if state is not None:
        body["state"] = state
    return JSONResponse(body, status_code=status)


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

    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException) -> JSONResponse:
        if isinstance(exc.detail, dict):  # 503 from `serving`
            detail: dict[str, str] = exc.detail
            return error(exc.status_code, detail["message"], "service_unavailable", state=detail["state"])
        return error(exc.status_code, str(exc.detail), "authentication_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, plain(exc.errors()), "invalid_request_error")

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
        return {"object": "list", "data": [card | {"weight_version": server.version}]}

    @app.post("/pause", dependencies=control)
    async def pause(
        server: RolloutServer = ready, mode: str = Query("wait"), timeout: float = Query(60.0, gt=0, le=86400)
    ) -> JSONResponse:
        if mode not in PAUSE_MODES:
            return error(400, f"mode must be wait, abort or keep; got {mode!r}", "invalid_request_error")
        parked = await asyncio.to_thread(server.pause, mode, timeout)
        return JSONResponse({"paused": True, "parked": parked, "mode": mode})

    @app.post("/resume", dependencies=control)
    async def resume(server: RolloutServer = ready) -> dict[str, Any]:
        server.resume()
        return {"paused": bool(server.loop.paused_by)}

    @app.get("/metrics", dependencies=control)
    async def metrics(server: RolloutServer = ready) -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", dependencies=generation)
    async def completions(body: CompletionRequest, server: RolloutServer = ready) -> JSONResponse:
        try:
            response = await complete(server, body, f"cmpl-{uuid.uuid4().hex[:12]}-{next(counter)}")
        except Exception as exc:  # never a bare "Internal Server Error": say what failed, and count it
            log.exception("completion request failed")
            response = error(500, f"the server failed: {type(exc).__name__}: {exc}", "server_error")
        server.metrics.requests.labels(str(response.status_code)).inc()
        return response

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


async def complete(server: RolloutServer, body: CompletionRequest, request_id: str) -> JSONResponse:
    if body.stream:
        return error(400, "streaming is not supported", "invalid_request_error")
    if body.top_p != 1.0:
        return error(400, "top_p other than 1 is not supported", "invalid_request_error")
    if body.model is not None and body.model != server.config.model_name:
        return error(404, f"model {body.model!r} is not served here; this is {server.config.model_name!r}", "not_found")
    if server.tokenizer is None and (body.stop or has_text(body.prompt)):
        return error(
            400,
            f"text prompts and stop strings need a tokenizer: {server.no_tokenizer}; send prompts as token ids",
            "invalid_request_error",
        )
    try:  # off the event loop: a long text takes a while, and /health must answer meanwhile
        prompts = await asyncio.to_thread(tokenize, server, body.prompt)
    except ValueError as exc:  # a RequestError, or the tokenizer refusing the text
        return error(400, str(exc), "invalid_request_error")
    if not await wait_at_gate(server):
        now = server.health()
        message = f"not serving after {server.config.ready_timeout} s: {now.reason}"
        return error(503, message, "service_unavailable", state=now.state)
    queues = submit(server, body, prompts, request_id)
    stop = cast(list[str] | None, body.stop)  # the request's validator made a lone string a list
    try:
        collected = await asyncio.gather(
            *(collect(server, queue, f"{request_id}-{index}", stop) for index, queue in enumerate(queues))
        )
    finally:  # the client went away or we failed: stop generating for it
        for index in range(len(queues)):
            server.loop.cancel(f"{request_id}-{index}")
    failed = next((c for c in collected if c.error is not None), None)
    if failed is not None:  # never a 200 without output: the engine's error, with its status
        return error(failed.error_status, failed.error or "", ERROR_TYPES.get(failed.error_status, "server_error"))
    choices = [c.choice(index, body.logprobs is not None) for index, c in enumerate(collected)]
    return JSONResponse(response(server, request_id, choices, prompts, body.n).model_dump(exclude_none=True))


def has_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def tokenize(server: RolloutServer, prompt: Any) -> list[list[int]]:
    """Prompt text, token ids, or a list of either -> one list of token ids per prompt."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt is empty")
    ids = [p if isinstance(p, list) else server.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for one in ids:
        if not one:
            raise RequestError("a prompt has no tokens")
        if min(one) < 0:
            raise RequestError(f"token id {min(one)} is negative")
    return ids


async def wait_at_gate(server: RolloutServer) -> bool:
    """Wait up to --ready-timeout for a committed, intact version (never serve dummy weights)."""
    if server.version is not None:
        return True
    server.metrics.waiting_at_gate.inc()
    try:
        deadline = time.monotonic() + server.config.ready_timeout
        while server.version is None and time.monotonic() < deadline:
            await asyncio.sleep(GATE_POLL_S)
        return server.version is not None
    finally:
        server.metrics.waiting_at_gate.dec()


def submit(
    server: RolloutServer, body: CompletionRequest, prompts: list[list[int]], request_id: str
) -> list[asyncio.Queue[TokenEvent]]:
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue[TokenEvent]] = []
    for prompt in prompts:
        for sample in range(body.n):
            queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
            params = SamplingParams(
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                seed=None if body.seed is None else body.seed + sample,
                logprobs=body.logprobs,
                stop_token_ids=tuple(body.stop_token_ids or ()),
            )

            def deliver(event: TokenEvent, queue: asyncio.Queue[TokenEvent] = queue) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, event)

            server.loop.submit(f"{request_id}-{len(queues)}", prompt, params, deliver)
            queues.append(queue)
    return queues


class Collected:
    """One choice's tokens as they came from the loop, with the versions that produced them.

    Stop strings are matched here, on the decoded text, so they work the same on every engine:
    the text ends before the first stop string, and the request is cancelled in the loop.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.last_version: int | None = None
        self.text_end: int | None = None
        """Where a stop string cut the text, once one was generated."""
        self.error: str | None = None
        self.error_status = 500

    @property
    def done(self) -> bool:
        return self.text_end is not None

    def add(self, event: TokenEvent) -> None:
        if event.token_ids and event.version is not None and (not self.versions or self.versions[-1] != event.version):
            self.versions.append(event.version)
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs or []
        self.top_logprobs += event.top_logprobs or []
        self.last_version = event.version
        self.finish_reason = event.finish_reason
        if event.error is not None:
            self.error, self.error_status = event.error, event.error_status
        if self.stop and event.token_ids:
            text = self.text()
            found = [at for at in (text.find(stop) for stop in self.stop) if at >= 0]
            if found:
                self.text_end, self.finish_reason = min(found), "stop"

    def text(self) -> str:
        if self.tokenizer is None:  # a model without a tokenizer: token ids only
            return ""
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)[: self.text_end]

    def piece(self, token: int) -> str:
        return str(token) if self.tokenizer is None else str(self.tokenizer.decode([token]))

    def choice(self, index: int, with_logprobs: bool) -> Choice:
        logprobs = None
        if with_logprobs:
            pieces = [self.piece(t) for t in self.token_ids]
            offsets = list(itertools.accumulate((len(p) for p in pieces), initial=0))[:-1]
            top = [{self.piece(t): lp for t, lp in one.items()} for one in self.top_logprobs]
            logprobs = Logprobs(
                tokens=pieces, token_logprobs=self.logprobs, top_logprobs=top or None, text_offset=offsets
            )
        versions = self.versions or ([self.last_version] if self.last_version is not None else [])
        return Choice(
            index=index,
            text=self.text(),
            token_ids=self.token_ids,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            weight_version=versions[-1] if versions else None,
            weight_versions=versions if len(versions) > 1 else None,
        )


async def collect(
    server: RolloutServer, queue: asyncio.Queue[TokenEvent], request_id: str, stop: list[str] | None
) -> Collected:
    collected = Collected(server.tokenizer, stop)
    while True:
        event = await queue.get()
        collected.add(event)
        if event.finished:
            return collected
        if collected.done:  # a stop string: no more tokens for this choice
            server.loop.cancel(request_id)
            return collected


def response(
    server: RolloutServer, request_id: str, choices: list[Choice], prompts: list[list[int]], n: int
) -> CompletionResponse:
    versions = sorted({v for c in choices for v in (c.weight_versions or (c.weight_version,)) if v is not None})
    completion_tokens = sum(len(c.token_ids) for c in choices)
    prompt_tokens = sum(len(p) for p in prompts)
    return CompletionResponse(
        id=request_id,
        created=int(time.time()),
        model=server.config.model_name,
        choices=choices,
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
        weight_version=versions[-1] if versions else None,
        weight_versions=versions if len(versions) > 1 else None,
    )
