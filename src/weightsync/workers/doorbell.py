"""The doorbell: how an engine's worker asks the API process to pause, commit or abort for a sync.

The weight receiver lives in the engine's worker (the weights are there, in vLLM's workers or
SGLang's TP workers), but pausing generation and labelling the weight version are the API
process's calls (vLLM's `AsyncLLM.pause_generation`, SGLang's tokenizer manager). So the worker
rings: one `SyncEvent` (events.py) per connection over a Unix stream socket, one `Reply`, then
the connection closes.

    ring(path, PushArrived(version=3, park=True), timeout) -> None | raises SinkError

The socket lives in a private temporary directory (mode 0700) of the user running the server:
nothing else on the host can connect. Frames are a 4-byte big-endian length and a msgspec JSON
value of exactly the events' types, at most `MAX_FRAME_BYTES`: no pickle, nothing a peer could
make us execute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from weightsync.errors import ProtocolError, SinkError
from weightsync.workers.events import Reply, SyncEvent, event_name

__all__ = ["Doorbell", "ring"]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 16
"""Events are a few hundred bytes; anything larger is not ours."""

_LENGTH = struct.Struct(">I")

Handler = Callable[[SyncEvent], Awaitable[Reply | None]]
"""Runs one event on the API process's loop: its reply (None: plain ok); raising refuses it (the
reply carries the message)."""

_EVENTS = msgspec.json.Decoder(SyncEvent)
_REPLIES = msgspec.json.Decoder(Reply)


def _frame(message: SyncEvent | Reply) -> bytes:
    body = msgspec.json.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"doorbell message of {len(body)} bytes (at most {MAX_FRAME_BYTES})")
    return _LENGTH.pack(len(body)) + body


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ProtocolError("the doorbell closed mid-message")
        data += chunk
    return bytes(data)


def ring(path: str, event: SyncEvent, timeout: float) -> Reply:
    """Send `event` to the doorbell at `path` and wait for its reply (blocking, bounded); the
    reply, when ok.

    Raises:
        SinkError: no reply within `timeout`, the doorbell is gone, or it refused the event.
    """
    name = event_name(event)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(_frame(event))
            (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"doorbell reply of {size} bytes")
            reply = _REPLIES.decode(_recv_exact(sock, size))
    except TimeoutError as exc:
        raise SinkError(f"the API process did not answer {name!r} within {timeout} s") from exc
    except (OSError, ProtocolError, msgspec.DecodeError) as exc:
        raise SinkError(f"the API process's doorbell failed on {name!r}: {exc}") from exc
    if not reply.ok:
        raise SinkError(reply.error or f"the API process refused {name!r}")
    return reply


class Doorbell:
    """The API process's end: answers each ring with `handler(event)` on the event loop.

    A handler that raises is answered `Reply(ok=False, error=...)` (the worker then fails the
    sync with that message); the doorbell itself keeps serving.
    """

    def __init__(self, handler: Handler, timeout: float) -> None:
        self._handler = handler
        self._timeout = timeout
        self._dir = tempfile.TemporaryDirectory(prefix="weightsync-bell-")
        os.chmod(self._dir.name, 0o700)
        self.path = str(Path(self._dir.name) / "bell.sock")
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            header = await asyncio.wait_for(reader.readexactly(_LENGTH.size), self._timeout)
            (size,) = _LENGTH.unpack(header)
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"doorbell message of {size} bytes")
            body = await asyncio.wait_for(reader.readexactly(size), self._timeout)
            writer.write(_frame(await self._answer(body)))
            await asyncio.wait_for(writer.drain(), self._timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ProtocolError, OSError) as exc:
            log.warning("a doorbell connection failed: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, body: bytes) -> Reply:
        """The handler's verdict on one frame; a frame that is no `SyncEvent` is refused unread."""
        try:
            event = _EVENTS.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError included: a wrong type or field
            log.warning("a doorbell message refused: %s", exc)
            return Reply(ok=False, error=f"not a sync event: {exc}")
        try:
            reply = await self._handler(event)
        except Exception as exc:
            log.warning("sync event %r refused: %s", event_name(event), exc)
            return Reply(ok=False, error=str(exc))
        return reply or Reply(ok=True)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):  # a ring still in its handler: the worker's wait ends in error
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self._timeout)
        self._dir.cleanup()
