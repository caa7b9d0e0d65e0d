"""A bound on request bodies, checked before anything is parsed or tokenised.

A prompt of 10 MB used to be read, parsed and tokenised on the event loop before its length was
checked: /health then took 10 s to answer and the process kept the memory. The bound is checked
on the bytes as they arrive (the declared Content-Length first), so an oversized body costs at
most the bound.

The default follows the model's context: `BODY_BYTES_PER_TOKEN` bytes per token of context (room
for a batch of about 30 full-context prompts as token ids, or about 15 as text), and never less
than `MIN_BODY_BYTES`.

A refused body is read on and dropped (up to `DRAIN_BYTES` or `DRAIN_S`) before the 413 goes out:
a client still sending would otherwise meet a reset connection and lose the 413 with it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from weightsync.serving.error_body import error_body

__all__ = ["BODY_BYTES_PER_TOKEN", "MIN_BODY_BYTES", "BodyLimit", "context_length", "default_max_request_bytes"]

BODY_BYTES_PER_TOKEN = 256
MIN_BODY_BYTES = 1 << 20
DRAIN_BYTES = 64 << 20
"""The most of a refused body read and dropped, so that its sender reads the 413."""
DRAIN_S = 5.0
"""The longest a refused body is drained."""
DEFAULT_CONTEXT = 32768
"""The context assumed for a config.json that names none."""

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "max_seq_len")

Scope = MutableMapping[str, Any]
Message = dict[str, Any]


def context_length(model_dir: str | Path) -> int:
    """The model's context in tokens, from its config.json (a nested text_config included)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return DEFAULT_CONTEXT


def default_max_request_bytes(model_dir: str | Path) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context_length(model_dir))


class BodyLimit:
    """ASGI middleware: a request whose body is over `limit` bytes gets a 413 with a JSON error,
    and the application never sees it.

    Args:
        app: the ASGI application.
        limit: the largest body accepted, in bytes.
        hint: how to change the limit (named in the error).
    """

    def __init__(self, app: Any, limit: int, hint: str = "") -> None:
        self.app = app
        self.limit = limit
        self.hint = hint

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await _drop_rest(headers, receive)
            await self._refuse(send, f"{int(declared)} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # read the body here, counting, before any of it is parsed
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                if message.get("more_body", False):
                    await _drop_rest(headers, receive)
                await self._refuse(send, f"more than {self.limit} bytes")
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, send: Any, size: str) -> None:
        message = f"a request body of {size} is over this server's limit of {self.limit} bytes"
        body = json.dumps(error_body(413, message + self.hint))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body.encode()})


async def _drop_rest(headers: dict[bytes, bytes], receive: Any) -> None:
    """Reads and drops what is left of a refused body, at most `DRAIN_BYTES` for at most
    `DRAIN_S`. A client waiting for `100 Continue` has sent nothing and is not asked to."""
    if headers.get(b"expect", b"").lower() == b"100-continue":
        return
    dropped = 0
    try:
        async with asyncio.timeout(DRAIN_S):
            while dropped < DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return


def _replay(messages: list[Message], receive: Any) -> Any:
    """A `receive` that gives `messages` first, then the real one (for the disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        message: Message = await receive()
        return message

    return replayed
