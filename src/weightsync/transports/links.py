"""Control links: how a sender reaches a receiver, and how a receiver listens. Two kinds.

- socket: a `wire.Connection` over a Unix socket in the abstract namespace (`scheme://@NAME`:
  nothing to clean up after a crash) or over TCP (`scheme://HOST:PORT`);
- in-process: a `QueueLink` pair through which the same typed messages pass as objects, with
  no encoding (`inproc://NAME`, a listener in this process).

Every link has the same surface (`Link` in base.py), so the conversation on both sides is written
once, whatever carries it. A listener runs `serve(link)` on a thread of its own per connection.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable

from weightsync.errors import (
    ConfigError,
    ConnectError,
    PeerClosedError,
    ProtocolError,
    ResourceError,
    TransferTimeout,
    TransportError,
)
from weightsync.messages import Message
from weightsync.pack import BucketItem
from weightsync.transports.base import Link, Listener
from weightsync.wire import MAX_FRAME_BYTES, Connection

__all__ = [
    "InprocListener",
    "QueueLink",
    "SocketListener",
    "check_address",
    "connect_inproc",
    "connect_tcp",
    "connect_unix",
    "parse_tcp_address",
]

log = logging.getLogger(__name__)

Serve = Callable[[Link], None]


# --- addresses ----------------------------------------------------------------------------------


def parse_tcp_address(address: str, scheme: str = "tcp") -> tuple[str, int]:
    """("host", port) from "tcp://host:port" (IPv6 hosts in brackets)."""
    rest = address.removeprefix(f"{scheme}://")
    host, sep, port = rest.rpartition(":")
    if not address.startswith(f"{scheme}://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{scheme} address must look like {scheme}://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def check_address(address: str, scheme: str, kind: str) -> None:
    """Raise ConfigError unless `address` is well formed for a link of `kind` (no I/O)."""
    rest = address.removeprefix(f"{scheme}://")
    if kind == "tcp":
        parse_tcp_address(address, scheme)
    elif kind == "unix" and (not rest.startswith("@") or len(rest) < 2):
        raise ConfigError(f"{scheme} address must look like {scheme}://@NAME, got {address!r}")
    elif kind == "inproc" and not rest:
        raise ConfigError(f"{scheme} address must look like {scheme}://NAME, got {address!r}")


def socket_link(link: Link) -> Connection:
    """`link` as the socket it is; ProtocolError for a data plane that needs one and got another."""
    if not isinstance(link, Connection):
        raise ProtocolError(f"transport {link.transport} needs a socket link", transport=link.transport)
    return link


def queue_link(link: Link) -> QueueLink:
    """`link` as the in-process link it is; ProtocolError otherwise."""
    if not isinstance(link, QueueLink):
        raise ProtocolError(f"transport {link.transport} needs an in-process link", transport=link.transport)
    return link


# --- socket links -------------------------------------------------------------------------------


def connect_unix(address: str, scheme: str, timeout: float, messages: tuple[type[Message], ...] = ()) -> Connection:
    check_address(address, scheme, "unix")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + address.removeprefix(f"{scheme}://@"))
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot reach receiver {address}: {exc.strerror or exc}", transport=scheme) from exc
    return Connection(sock, scheme, messages)


def connect_tcp(address: str, scheme: str, timeout: float, messages: tuple[type[Message], ...] = ()) -> Connection:
    host, port = parse_tcp_address(address, scheme)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ConnectError(f"cannot reach receiver {address}: {exc.strerror or exc}", transport=scheme) from exc
    _tune(sock)
    return Connection(sock, scheme, messages)


def _tune(sock: socket.socket) -> None:
    # Control frames are small and latency-bound. Buffer sizes are left to the kernel's
    # autotuning, which on loopback did as well as any fixed size we tried.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class SocketListener:
    """Accepts connections on a Unix socket (abstract namespace) or a TCP port."""

    def __init__(
        self, scheme: str, kind: str, *, host: str, port: int, timeout: float, messages: tuple[type[Message], ...] = ()
    ) -> None:
        self.scheme = scheme
        self.messages = messages
        self.timeout = timeout
        self._sock = _unix_listener(scheme) if kind == "unix" else _tcp_listener(host, port)
        name = self._sock.getsockname()
        if kind == "unix":
            self.address = f"{scheme}://@{name[1:].decode() if isinstance(name, bytes) else name[1:]}"
        else:
            self.address = f"{scheme}://{f'[{name[0]}]' if ':' in name[0] else name[0]}:{name[1]}"
        self._threads = _Threads(scheme)

    def start(self, serve: Serve) -> None:
        self._threads.spawn(self._accept_loop, "accept", serve)

    def _accept_loop(self, serve: Serve) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._threads.serve(serve, Connection(sock, self.scheme, self.messages))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._threads.close(self.timeout)


def _unix_listener(scheme: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(f"\0weightsync-{secrets.token_hex(8)}")  # abstract namespace: nothing to clean up after a crash
    sock.listen(64)
    return sock


def _tcp_listener(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _tune(sock)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ResourceError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(64)
    return sock


class _Threads:
    """The threads a listener started and the links they serve: the links closed and the
    threads joined (with a bound) when it closes."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._links: set[Link] = set()

    def spawn(self, target: Callable[..., None], role: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"weightsync-{self.scheme}-{role}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def serve(self, serve: Serve, link: Link) -> None:
        """Run `serve(link)` on a thread of its own, and close the link when it returns."""
        with self._lock:
            self._links.add(link)
        self.spawn(self._serve_one, "conn", serve, link)

    def _serve_one(self, serve: Serve, link: Link) -> None:
        try:
            serve(link)
        finally:
            with self._lock:
                self._links.discard(link)
            link.close()

    def close(self, timeout: float) -> None:
        """Close every link, and wait for every thread (a sync in flight aborts, and tells its
        sink, before this returns)."""
        with self._lock:
            links, threads = list(self._links), list(self._threads)
        for link in links:
            link.close()
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


# --- in-process links ---------------------------------------------------------------------------


class _Mailbox:
    """One direction of an in-process link: messages in order, and whether the link closed."""

    def __init__(self) -> None:
        self._items: collections.deque[Message] = collections.deque()
        self._ready = threading.Condition()
        self.closed = False

    def put(self, message: Message) -> None:
        with self._ready:
            self._items.append(message)
            self._ready.notify_all()

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify_all()

    def wait(self, timeout: float | None) -> bool:
        """True once a message waits or the link closed; False after `timeout`."""
        with self._ready:
            return self._ready.wait_for(lambda: bool(self._items) or self.closed, timeout)

    def take(self) -> Message | None:
        with self._ready:
            return self._items.popleft() if self._items else None


class QueueLink:
    """One end of an in-process control link: the same messages as a socket link, as objects.

    The pair also hands bucket items over (`hand_over` / `take_over`): the in-process data plane
    copies straight from the sender's tensors."""

    def __init__(self, transport: str, inbox: _Mailbox, outbox: _Mailbox, items: dict[int, list[BucketItem]]) -> None:
        self.transport = transport
        self._inbox, self._outbox = inbox, outbox
        self._items = items
        self._items_lock = threading.Lock()

    @classmethod
    def pair(cls, transport: str) -> tuple[QueueLink, QueueLink]:
        forward, backward = _Mailbox(), _Mailbox()
        items: dict[int, list[BucketItem]] = {}
        return cls(transport, backward, forward, items), cls(transport, forward, backward, items)

    def send(self, message: Message, timeout: float | None) -> None:
        if self._outbox.closed or self._inbox.closed:
            raise self._error(PeerClosedError, "peer closed the connection")
        self._outbox.put(message)

    def recv(self, timeout: float | None, max_bytes: int = MAX_FRAME_BYTES) -> Message:
        if not self._inbox.wait(timeout):
            raise self._error(TransferTimeout, f"no progress from peer within {timeout} s")
        message = self._inbox.take()
        if message is None:
            raise self._error(PeerClosedError, "peer closed the connection")
        return message

    def wait_readable(self) -> None:
        self._inbox.wait(None)

    def closed_by_peer(self) -> bool:
        return self._inbox.closed

    def close(self) -> None:
        self._inbox.close()
        self._outbox.close()
        with self._items_lock:
            self._items.clear()

    def hand_over(self, index: int, items: list[BucketItem]) -> None:
        with self._items_lock:
            self._items[index] = items

    def take_over(self, index: int) -> list[BucketItem] | None:
        with self._items_lock:
            return self._items.pop(index, None)

    def _error(self, cls: type[TransportError], message: str) -> TransportError:
        return cls(message, transport=self.transport)


_LISTENING: weakref.WeakValueDictionary[str, InprocListener] = weakref.WeakValueDictionary()


class InprocListener:
    """A listener in this process: a sender's `connect_inproc` hands it one end of a link pair."""

    def __init__(self, scheme: str, *, timeout: float) -> None:
        self.scheme = scheme
        self.timeout = timeout
        self.address = f"{scheme}://{secrets.token_hex(8)}"
        self._serve: Serve | None = None
        self._threads = _Threads(scheme)

    def start(self, serve: Serve) -> None:
        self._serve = serve
        _LISTENING[self.address] = self

    def accept(self, link: QueueLink) -> None:
        serve = self._serve
        if serve is None:
            raise ConnectError(f"receiver {self.address} is not listening", transport=self.scheme)
        self._threads.serve(serve, link)

    def close(self) -> None:
        _LISTENING.pop(self.address, None)
        self._serve = None
        self._threads.close(self.timeout)


def connect_inproc(address: str, scheme: str, timeout: float) -> QueueLink:
    check_address(address, scheme, "inproc")
    listener = _LISTENING.get(address)
    if listener is None:
        raise ConnectError(f"no receiver listening at {address} in this process", transport=scheme)
    ours, theirs = QueueLink.pair(scheme)
    listener.accept(theirs)
    return ours


def listener_for(
    kind: str, scheme: str, *, host: str, port: int, timeout: float, messages: tuple[type[Message], ...] = ()
) -> Listener:
    """A listener for links of `kind` ("unix", "tcp" or "inproc") that carry the core messages
    and `messages` (the transport's own)."""
    if kind == "inproc":
        return InprocListener(scheme, timeout=timeout)
    return SocketListener(scheme, kind, host=host, port=port, timeout=timeout, messages=messages)


def opener(kind: str, scheme: str, messages: tuple[type[Message], ...] = ()) -> Callable[[str, float], Link]:
    """What opens a link of `kind` to a receiver of transport `scheme`: (address, timeout) -> Link."""

    def open_link(address: str, timeout: float) -> Link:
        if kind == "inproc":
            return connect_inproc(address, scheme, timeout)
        if kind == "unix":
            return connect_unix(address, scheme, timeout, messages)
        return connect_tcp(address, scheme, timeout, messages)

    return open_link
