"""Framing and encoding: typed control messages and raw byte runs over a stream socket.

A frame is a 4-byte big-endian length followed by a msgpack-encoded `Message`. A connection
decodes only the core messages and its transport's own (no pickle, no arbitrary objects), and a frame's
length is checked against `MAX_FRAME_BYTES` before anything is allocated for it. Raw payload
bytes are never framed: a message announces them (`BucketData.nbytes`) and they follow as is.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
from collections.abc import Callable
from functools import cache
from typing import Any, ParamSpec, TypeVar, Union

import msgspec

from weightsync.errors import PeerClosedError, ProtocolError, TransferTimeout, TransportError
from weightsync.messages import CORE_MESSAGES, Message

__all__ = ["HANDSHAKE_FRAME_BYTES", "MAX_FRAME_BYTES", "Connection", "decode", "encode"]

MAX_FRAME_BYTES = 64 << 20
"""The largest control frame accepted: a plan for ~500k tensors. Payload bytes are not framed."""
HANDSHAKE_FRAME_BYTES = 64 << 10
"""The bound on frames from a peer not yet authenticated (Hello, and Auth where a token is
required): a stranger cannot make a receiver allocate more than this per connection."""

STREAM_CHUNK_BYTES = 1 << 20
"""Raw bytes move through the socket in slices of this size: on loopback, 256 KiB-1 MiB slices ran
about 1.5x faster than 32 MiB ones (the kernel's copies stay in cache)."""

_HEADER = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()

_P = ParamSpec("_P")
_T = TypeVar("_T")


_TCP_ESTABLISHED = 1  # the first byte of Linux's struct tcp_info: the connection's state


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


@cache
def _decoder(messages: tuple[type[Message], ...]) -> msgspec.msgpack.Decoder[Message]:
    return msgspec.msgpack.Decoder(Union[CORE_MESSAGES + messages])  # noqa: UP007


def decode(data: bytes | bytearray | memoryview, messages: tuple[type[Message], ...] = ()) -> Message:
    """Decode one message, a core one or one of `messages` (a transport's own); anything else
    raises ProtocolError."""
    try:
        return _decoder(messages).decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:  # a str field may hold invalid UTF-8 (found by atheris)
        raise ProtocolError(f"malformed control message: {exc}") from exc


class Connection:
    """A connected stream socket carrying frames and raw byte runs, every wait bounded.

    Its errors name the transport; the sync loops add the version and bucket. Timeouts are in seconds; None waits forever and is used only between syncs. `messages`: the
    transport's own messages, decoded besides the core ones.
    """

    def __init__(self, sock: socket.socket, transport: str, messages: tuple[type[Message], ...] = ()) -> None:
        self.sock = sock
        self.transport = transport
        self.messages = messages

    def send(self, message: Message, timeout: float | None) -> None:
        body = encode(message)
        self._call(timeout, self.sock.sendall, _HEADER.pack(len(body)) + body)

    def recv(self, timeout: float | None, max_bytes: int = MAX_FRAME_BYTES) -> Message:
        """The next message; a frame longer than `max_bytes` is refused before it is read."""
        header = bytearray(_HEADER.size)
        self.recv_into(memoryview(header), timeout)
        (length,) = _HEADER.unpack(header)
        if length > max_bytes:
            raise self._error(ProtocolError, f"control frame of {length} bytes exceeds {max_bytes}")
        body = bytearray(length)
        self.recv_into(memoryview(body), timeout)
        return decode(body, self.messages)

    def send_bytes(self, data: Any, timeout: float | None) -> None:
        """Send a buffer as is (zero copy from the caller's memory)."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), STREAM_CHUNK_BYTES):
            self._call(timeout, self.sock.sendall, view[start : start + STREAM_CHUNK_BYTES])

    def recv_into(self, buffer: Any, timeout: float | None) -> None:
        """Fill `buffer` (any writable buffer) completely from the socket."""
        view = memoryview(buffer).cast("B")
        received = 0
        while received < len(view):
            count = self._call(timeout, self.sock.recv_into, view[received : received + STREAM_CHUNK_BYTES])
            if count == 0:
                raise self._error(PeerClosedError, "peer closed the connection")
            received += count

    def wait_readable(self) -> None:
        """Block until a read would not block (data, EOF or an error), leaving timeouts alone.

        Polls in short rounds so that a socket closed by another thread (which wakes no poller)
        is noticed; the read that follows then reports the closed connection.
        """
        poller = select.poll()
        fd = self.sock.fileno()
        if fd < 0:
            return
        poller.register(fd, select.POLLIN | select.POLLPRI)
        while not poller.poll(250) and self.sock.fileno() >= 0:
            pass

    def closed_by_peer(self) -> bool:
        """Whether the other end has closed the connection (or it broke), without reading: a TCP
        connection's state says so even with data still unread; a Unix socket's EOF shows in a
        peek once everything before it was read."""
        try:
            if self.sock.family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_INFO"):
                return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != _TCP_ESTABLISHED
            readable, _, _ = select.select([self.sock], [], [], 0)  # (a timed socket's recv would wait)
            return bool(readable) and self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # ValueError: our own side closed it already
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _call(self, timeout: float | None, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            self.sock.settimeout(timeout)
            return fn(*args, **kwargs)
        except TimeoutError as exc:
            raise self._error(TransferTimeout, f"no progress from peer within {timeout} s") from exc
        except (ConnectionError, OSError) as exc:
            raise self._error(PeerClosedError, f"connection lost: {exc}") from exc

    def _error(self, cls: type[TransportError], message: str) -> TransportError:
        return cls(message, transport=self.transport)
