"""The doorbell: how vLLM's worker asks the API process to pause, commit or abort for a sync.

The weight receiver lives in vLLM's worker (the weights are there), but pausing generation and
labelling the weight version are the API process's calls (`AsyncLLM.pause_generation`,
`update_weight_version`). So the worker rings: one small JSON request per event over a Unix
stream socket, one JSON reply, then the connection closes.

    ring(path, {"event": "begin", ...}, timeout) -> {"ok": true, ...} | raises SinkError

The socket lives in a private temporary directory (mode 0700) of the user running the server:
nothing else on the host can connect. Frames are a 4-byte big-endian length and a JSON object
(msgspec), at most `MAX_FRAME_BYTES`: no pickle, nothing a peer could make us execute.
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

__all__ = ["Doorbell", "ring"]

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 16
"""Events are a few hundred bytes; anything larger is not ours."""

_LENGTH = struct.Struct(">I")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _encode(message: dict[str, Any]) -> bytes:
    body = msgspec.json.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"doorbell message of {len(body)} bytes (at most {MAX_FRAME_BYTES})")
    return _LENGTH.pack(len(body)) + body


def _decode(body: bytes) -> dict[str, Any]:
    try:
        message = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"doorbell message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("doorbell message is not a JSON object")
    return message


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ProtocolError("the doorbell closed mid-message")
        data += chunk
    return bytes(data)


def ring(path: str, message: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send `message` to the doorbell at `path` and return its reply (blocking, bounded).

    Raises:
        SinkError: no reply within `timeout`, the doorbell is gone, or it said no (`ok` false).
    """
    event = message.get("event", "?")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(_encode(message))
            (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"doorbell reply of {size} bytes")
            reply = _decode(_recv_exact(sock, size))
    except TimeoutError as exc:
        raise SinkError(f"the API process did not answer {event!r} within {timeout} s") from exc
    except (OSError, ProtocolError) as exc:
        raise SinkError(f"the API process's doorbell failed on {event!r}: {exc}") from exc
    if not reply.get("ok"):
        raise SinkError(str(reply.get("error") or f"the API process refused {event!r}"))
    return reply


class Doorbell:
    """The API process's end: answers each ring with `handler(message)` on the event loop.

    A handler that raises is answered `{"ok": false, "error": ...}` (the worker then fails the
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
            message = _decode(await asyncio.wait_for(reader.readexactly(size), self._timeout))
            reply: dict[str, Any]
            try:
                reply = {"ok": True} | await self._handler(message)
            except Exception as exc:
                log.warning("sync event %r refused: %s", message.get("event"), exc)
                reply = {"ok": False, "error": str(exc)}
            writer.write(_encode(reply))
            await asyncio.wait_for(writer.drain(), self._timeout)
        except (TimeoutError, asyncio.IncompleteReadError, ProtocolError, OSError) as exc:
            log.warning("a doorbell connection failed: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

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
