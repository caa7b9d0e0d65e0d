"""Streamed responses (`stream: true`): server-sent events, as OpenAI and vLLM send them.

    data: {chunk}\\n\\n      one per choice per engine step that gave it something new
    data: {usage chunk}      with stream_options.include_usage: no choices, the request's usage
    data: [DONE]

The stream starts only once every choice has had its first event from the engine: a request the
engine refuses (a prompt longer than the context, say) or fails on at once still gets a plain
error response with its status, as when not streamed. A failure after that (the engine fails a
step mid-generation) cannot change the status any more: the stream sends one error event, the
same JSON object as an error response (`{"error": {...}}`, which the `openai` client raises as an
`APIError`), cancels the other choices, and ends with `data: [DONE]`, as vLLM does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, StreamingResponse

from weightsync.serving.error_body import error, error_body
from weightsync.serving.hf.formats import Format, dump
from weightsync.serving.hf.generation import Generation
from weightsync.serving.metrics import ServerMetrics

__all__ = ["DONE", "stream"]

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def stream(
    generation: Generation, fmt: Format, created: int, model: str, include_usage: bool, metrics: ServerMetrics
) -> StreamingResponse | JSONResponse:
    """A streamed response for `generation` (just submitted), or an error response if it failed
    before its first chunk; counts the request in `metrics` either way."""
    started: list[int] = []
    try:
        while len(set(started)) < len(generation.outputs) and generation.failure is None:
            started.append(await generation.next())
    except BaseException:
        generation.cancel()
        raise
    failed = generation.failure
    if failed is not None:
        generation.cancel()
        metrics.requests.labels(str(failed.error_status)).inc()
        return error(failed.error_status, failed.error or "the engine failed")
    request_id = generation.request_id
    sent: set[int] = set()

    def chunk(index: int) -> str:
        output = generation.outputs[index]
        first = index not in sent
        sent.add(index)
        return event(dump(fmt.chunk(request_id, created, model, index, output, output.delta(), first)))

    async def events() -> AsyncIterator[str]:
        status = 200
        try:
            for index in dict.fromkeys(started):
                yield chunk(index)
            while not generation.finished:
                index = await generation.next()
                failed = generation.outputs[index]
                if failed.error is not None:
                    status = failed.error_status
                    yield event(error_body(status, failed.error))
                    break
                yield chunk(index)
            else:
                if include_usage:
                    yield event(dump(fmt.usage_chunk(request_id, created, model, generation)))
        except Exception as exc:  # a bug of ours mid-stream: say so in the stream, as the engine's failures are
            log.exception("streamed request %s failed", request_id)
            status = 500
            yield event(error_body(status, f"the server failed: {type(exc).__name__}: {exc}"))
        finally:  # done, failed, or the client went away: nothing of this request keeps generating
            generation.cancel()
            metrics.requests.labels(str(status)).inc()
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")
