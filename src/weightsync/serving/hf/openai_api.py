"""POST /v1/completions and /v1/chat/completions: check the request, tokenise it on a worker
thread, generate, and answer whole or streamed (the HTTP face's gate admitted it once a version
was servable).

Every refusal is an error response in one shape (`error_body`): 400 for a request this server
cannot serve, 404 for a name that is neither the model's nor a LoRA adapter's it serves, 503 when
the weights turned dirty since the gate, and the engine's own status (400, 503 or 500) when it
refuses or fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.responses import JSONResponse, Response

from weightsync.serving.error_body import error
from weightsync.serving.hf.base import SamplingParams
from weightsync.serving.hf.formats import ChatFormat, CompletionFormat, Format, dump
from weightsync.serving.hf.generation import Generation
from weightsync.serving.hf.prompts import chat_prompt, has_text, no_chat_reason, tokenize
from weightsync.serving.hf.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from weightsync.serving.hf.server import RolloutServer
from weightsync.serving.hf.streaming import stream

__all__ = ["chat_completions", "completions"]


async def completions(server: RolloutServer, body: CompletionRequest, request_id: str) -> Response:
    if server.tokenizer is None and (body.stop or has_text(body.prompt)):
        return error(
            400,
            f"text prompts and stop strings need a tokenizer: {server.no_tokenizer}; send prompts as token ids",
            "prompt",
        )
    fmt = CompletionFormat(body.logprobs)
    return await generate(server, body, request_id, lambda: tokenize(server.tokenizer, body.prompt), fmt)


async def chat_completions(server: RolloutServer, body: ChatCompletionRequest, request_id: str) -> Response:
    why_not = no_chat_reason(server.tokenizer, server.no_tokenizer)
    if why_not is not None:
        return error(400, why_not, "messages")
    fmt = ChatFormat((body.top_logprobs or 0) if body.logprobs else None)
    return await generate(server, body, request_id, lambda: [chat_prompt(server.tokenizer, body.messages)], fmt)


async def generate(
    server: RolloutServer,
    body: GenerationRequest,
    request_id: str,
    prompts_of: Callable[[], list[list[int]]],
    fmt: Format,
) -> Response:
    """The work both endpoints share, from tokenising to the response."""
    if body.top_p != 1.0:
        return error(400, "top_p other than 1 is not supported", "top_p")
    adapter = None
    if body.model is not None and body.model != server.config.model_name:
        served = list(server.control.adapters)
        if body.model not in served:
            names = ", ".join(repr(name) for name in [server.config.model_name, *served])
            return error(404, f"model {body.model!r} is not served here; this serves {names}", "model")
        adapter = body.model
    try:  # off the event loop: a long text takes a while, and /health must answer meanwhile
        prompts = await asyncio.to_thread(prompts_of)
    except ValueError as exc:  # a RequestError, or the tokenizer refusing the text
        return error(400, str(exc))
    version = server.version  # the HTTP face's gate admitted this request once a version was servable
    if version is None:  # a sync failed half-written since: the weights are dirty
        now = server.health()
        return error(503, now.reason, state=now.state)
    generation = Generation(
        server, request_id, prompts, body.n, sampling(body, fmt.logprobs, adapter), body.stop_strings, version
    )
    created, model = int(time.time()), adapter or server.config.model_name
    if body.stream:
        return await stream(generation, fmt, created, model, body.include_usage, server.metrics)
    try:
        while not generation.finished and generation.failure is None:
            await generation.next()
    finally:  # done, failed, or the client went away: nothing of this request keeps generating
        generation.cancel()
    failed = generation.failure
    if failed is not None:  # never a 200 without output: the engine's error, with its status
        return error(failed.error_status, failed.error or "the engine failed")
    return JSONResponse(dump(fmt.response(request_id, created, model, generation)))


def sampling(body: GenerationRequest, logprobs: int | None, adapter: str | None) -> Callable[[int], SamplingParams]:
    """Sample k's parameters: seeded `seed + k`, so the choices of one prompt differ; with the
    LoRA adapter the request named, if any."""

    def params(sample: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=body.max_new_tokens,
            temperature=body.temperature,
            seed=None if body.seed is None else body.seed + sample,
            logprobs=logprobs,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            adapter=adapter,
        )

    return params
