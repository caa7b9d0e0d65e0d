"""The doorbell between vLLM's worker and the API process: JSON request and reply, bounded waits,
refusals carried back as SinkError."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from weightsync.errors import SinkError
from weightsync.vllm_server.doorbell import MAX_FRAME_BYTES, Doorbell, ring


@contextmanager
def doorbell(handler: Any, timeout: float = 5.0) -> Iterator[Doorbell]:
    """A Doorbell serving on an event loop in a thread (the worker side calls `ring` from here)."""
    loop = asyncio.new_event_loop()
    bell = Doorbell(handler, timeout)
    loop.run_until_complete(bell.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield bell
    finally:
        asyncio.run_coroutine_threadsafe(bell.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_ring_gets_the_handlers_reply() -> None:
    seen = []

    async def handler(message: dict[str, Any]) -> dict[str, Any]:
        seen.append(message)
        return {"echo": message["version"]}

    with doorbell(handler) as bell:
        assert ring(bell.path, {"event": "begin", "version": 3}, 5.0) == {"ok": True, "echo": 3}
        assert stat.S_IMODE(os.stat(os.path.dirname(bell.path)).st_mode) == 0o700
    assert seen == [{"event": "begin", "version": 3}]


def test_a_refusal_comes_back_as_a_sink_error_with_the_reason() -> None:
    async def handler(message: dict[str, Any]) -> dict[str, Any]:
        raise SinkError("generation did not pause")

    with doorbell(handler) as bell, pytest.raises(SinkError, match="generation did not pause"):
        ring(bell.path, {"event": "begin", "version": 1}, 5.0)


def test_a_silent_api_process_fails_the_ring_within_its_timeout() -> None:
    release = threading.Event()

    async def handler(message: dict[str, Any]) -> dict[str, Any]:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 5)
        return {}

    with doorbell(handler) as bell:
        try:
            with pytest.raises(SinkError, match="did not answer 'begin' within 0.2 s"):
                ring(bell.path, {"event": "begin", "version": 1}, 0.2)
        finally:
            release.set()


def test_a_gone_doorbell_and_an_oversized_frame_are_sink_errors(tmp_path) -> None:
    with pytest.raises(SinkError, match="doorbell failed"):
        ring(str(tmp_path / "none.sock"), {"event": "begin", "version": 1}, 1.0)

    async def handler(message: dict[str, Any]) -> dict[str, Any]:
        return {}

    with doorbell(handler) as bell:
        with pytest.raises(SinkError):
            ring(bell.path, {"event": "x" * MAX_FRAME_BYTES, "version": 1}, 1.0)
        with socket.socket(socket.AF_UNIX) as sock:  # a frame claiming more than the limit: dropped
            sock.settimeout(5)
            sock.connect(bell.path)
            sock.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
            assert sock.recv(16) == b""
        assert ring(bell.path, {"event": "status", "version": 1}, 5.0) == {"ok": True}
