"""The doorbell between vLLM's worker and the API process: typed events and replies, bounded
waits, refusals and anything that is not a sync event carried back as SinkError."""

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
from weightsync.workers.doorbell import MAX_FRAME_BYTES, Doorbell, ring
from weightsync.workers.events import PushArrived, ReceiverChanged, SyncEvent, VersionFailed


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


def raw_ring(path: str, body: bytes) -> bytes:
    """Send one frame of arbitrary bytes, as a peer that is not our worker might; return the reply."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(len(body).to_bytes(4, "big") + body)
        reply = b""
        while chunk := sock.recv(1 << 16):
            reply += chunk
        return reply[4:]


def test_a_ring_reaches_the_handler_as_the_typed_event() -> None:
    seen: list[SyncEvent] = []

    async def handler(event: SyncEvent) -> None:
        seen.append(event)

    with doorbell(handler) as bell:
        ring(bell.path, PushArrived(version=3, total_bytes=10, park=True), 5.0)
        ring(bell.path, VersionFailed(version=3, intact=False, error="sender died"), 5.0)
        assert stat.S_IMODE(os.stat(os.path.dirname(bell.path)).st_mode) == 0o700
    assert seen == [
        PushArrived(version=3, total_bytes=10, park=True),
        VersionFailed(version=3, intact=False, error="sender died"),
    ]


def test_a_refusal_comes_back_as_a_sink_error_with_the_reason() -> None:
    async def handler(event: SyncEvent) -> None:
        raise SinkError("generation did not pause")

    with doorbell(handler) as bell, pytest.raises(SinkError, match="generation did not pause"):
        ring(bell.path, PushArrived(version=1), 5.0)


def test_a_silent_api_process_fails_the_ring_within_its_timeout() -> None:
    release = threading.Event()

    async def handler(event: SyncEvent) -> None:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 5)

    with doorbell(handler) as bell:
        try:
            with pytest.raises(SinkError, match="did not answer 'push_arrived' within 0.2 s"):
                ring(bell.path, PushArrived(version=1), 0.2)
        finally:
            release.set()


@pytest.mark.parametrize(
    "body",
    [
        b'{"type": "explode", "version": 1}',  # no such event
        b'{"type": "commit"}',  # no version
        b'{"type": "commit", "version": "1"}',  # a version that is not an int
        b'{"type": "abort", "version": 1, "intact": "yes"}',
        b"[1, 2]",
        b"\x80not json",
    ],
)
def test_anything_that_is_not_a_sync_event_is_refused_before_the_handler(body: bytes) -> None:
    seen: list[SyncEvent] = []

    async def handler(event: SyncEvent) -> None:
        seen.append(event)

    with doorbell(handler) as bell:
        reply = raw_ring(bell.path, body)
    assert reply.startswith(b'{"ok":false,"error":"not a sync event') and seen == []


def test_a_gone_doorbell_and_an_oversized_frame_are_sink_errors(tmp_path) -> None:
    with pytest.raises(SinkError, match="doorbell failed"):
        ring(str(tmp_path / "none.sock"), PushArrived(version=1), 1.0)

    async def handler(event: SyncEvent) -> None:
        return None

    with doorbell(handler) as bell:
        with pytest.raises(SinkError, match="at most"):
            ring(bell.path, ReceiverChanged(last_error="x" * MAX_FRAME_BYTES), 1.0)
        with socket.socket(socket.AF_UNIX) as sock:  # a frame claiming more than the limit: dropped
            sock.settimeout(5)
            sock.connect(bell.path)
            sock.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
            assert sock.recv(16) == b""
        ring(bell.path, ReceiverChanged(state="ready"), 5.0)  # and the doorbell serves on
