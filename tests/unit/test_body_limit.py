"""BodyLimit at the ASGI level: a body over the bound never reaches the app, the 413 names the
bound, and what the client is still sending is read and dropped first (so that it reads the 413
instead of a reset connection), within a bound of its own."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from weightsync.serving import body_limit
from weightsync.serving.body_limit import BodyLimit


async def _never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app saw a refused body")


def _run(headers: list[tuple[bytes, bytes]], chunks: list[bytes], limit: int = 1024) -> tuple[list[dict], int]:
    """Runs a request through BodyLimit; returns what it sent and how many chunks it read."""
    sent: list[dict] = []
    read = 0

    async def receive() -> dict:
        nonlocal read
        read += 1
        if read > len(chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": headers}
    asyncio.run(BodyLimit(_never_called, limit, " (--max-request-bytes)")(scope, receive, send))
    return sent, read


def _refused(sent: list[dict]) -> str:
    assert sent[0]["status"] == 413
    return json.loads(sent[1]["body"])["error"]["message"]


def test_a_body_counted_over_the_bound_is_refused_after_the_rest_is_dropped() -> None:
    chunks = [b"a" * 600] * 10
    sent, read = _run([], chunks)
    assert "more than 1024 bytes" in _refused(sent) and "--max-request-bytes" in _refused(sent)
    assert read == len(chunks), "the rest of the body was read and dropped before the 413"


def test_a_declared_length_over_the_bound_is_refused_and_the_body_dropped() -> None:
    chunks = [b"a" * 600] * 4
    sent, read = _run([(b"content-length", b"2400")], chunks)
    assert "a request body of 2400 bytes" in _refused(sent)
    assert read == len(chunks)


def test_a_client_waiting_for_100_continue_is_not_drained() -> None:
    headers = [(b"content-length", b"2400"), (b"expect", b"100-continue")]
    sent, read = _run(headers, [b"a" * 2400])
    assert "2400 bytes" in _refused(sent)
    assert read == 0, "receive() would have asked the client to send the body it is refused"


def test_the_drop_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(body_limit, "DRAIN_BYTES", 3000)
    sent, read = _run([], [b"a" * 1000] * 50)
    assert _refused(sent) and read == 2 + 3, "two chunks counted, three dropped, then the 413"


def test_a_body_within_the_bound_reaches_the_app_whole() -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive_parts() -> dict:
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    async def send(message: dict) -> None:
        pass

    parts = [b"ab", b"cd"]
    asyncio.run(BodyLimit(app, 1024)({"type": "http", "headers": []}, receive_parts, send))
    assert seen == [b"abcd"]
