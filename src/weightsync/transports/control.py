"""The control channel: the conversation of a sync, over links of any kind.

`SenderChannel` is the sender's end for the receivers of one transport: it connects (Hello,
Welcome, Auth), offers, commits and aborts, each step returning what happened per receiver. Replies
are read by a thread per link into an inbox, so the sender waits on several receivers with one
deadline. `welcome_sender` and `first_message` are the receiver's end of the handshake;
`next_message` and `expect_on` are the receiver's reads, shared by the receive loop and the data
planes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import msgspec

from weightsync.auth import TOKEN_ENV, new_nonce, proof, proof_matches
from weightsync.errors import (
    AuthError,
    PeerClosedError,
    ProtocolError,
    RemoteError,
    TransferTimeout,
    WeightSyncError,
)
from weightsync.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accept,
    Auth,
    BucketDone,
    Commit,
    Committed,
    Failed,
    Hello,
    Message,
    Offer,
    Welcome,
)
from weightsync.transports.base import Failures, Link
from weightsync.wire import HANDSHAKE_FRAME_BYTES, MAX_FRAME_BYTES

__all__ = ["SenderChannel", "expect_on", "first_message", "next_message", "welcome_sender"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

CLOSE_GRACE_S = 1.0
"""How long a sender waits, after a receiver's link broke, for the reason it sent before closing."""


class _Inbox:
    """Messages a receiver sends back, read by a background thread."""

    def __init__(self, link: Link, timeout: float) -> None:
        self._timeout = timeout
        self._queue: queue.Queue[Message | WeightSyncError] = queue.Queue()
        self.closed = threading.Event()
        """Set once the link is gone: the receiver closed it, died, or sent garbage."""
        threading.Thread(target=self._read, args=(link,), daemon=True, name="weightsync-inbox").start()

    def _read(self, link: Link) -> None:
        while True:
            try:
                # Wait for data without touching the socket's timeout: the sender thread uses the
                # same socket, and switching it to blocking mode under a send in flight turns
                # that send into EAGAIN. Reads then use the sender's own timeout, unchanged.
                link.wait_readable()
                self._queue.put(link.recv(self._timeout))
            except WeightSyncError as exc:
                self._queue.put(exc)
                self.closed.set()
                return

    def reason(self) -> RemoteError | None:
        """The receiver's own failure message, if one is waiting in the inbox."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return None
            if isinstance(item, Failed):
                return RemoteError(item.message, kind=item.kind)

    def get(self, deadline: float, link: Link) -> Message:
        try:
            item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TransferTimeout("peer sent no reply in time", transport=link.transport) from None
        if isinstance(item, WeightSyncError):
            raise item
        if isinstance(item, Failed):
            raise RemoteError(item.message, kind=item.kind)
        return item


class SenderChannel:
    """The sender's links to the receivers of one transport.

    Args:
        scheme: the transport's name (for errors).
        auth_token: the shared token receivers must prove, or None.
    """

    def __init__(
        self, scheme: str, open_link: Callable[[str, float], Link], *, timeout: float, auth_token: str | None
    ) -> None:
        self.scheme = scheme
        self.timeout = timeout
        self._open_link = open_link
        self._token = auth_token
        self._links: dict[str, Link] = {}
        self._inboxes: dict[str, _Inbox] = {}
        self._welcomes: dict[str, Welcome] = {}
        self._lends: dict[str, bool] = {}
        """Each receiver's last `Accept.lends`."""
        self._acked: dict[str, int] = {}
        """The credit window: the last bucket of this sync each receiver acked (`BucketDone`)."""
        self._pools: list[tuple[int, ThreadPoolExecutor]] = []
        """The pools of parallel sends, by size, the largest last: one outgrown may still serve
        another delivery (a sharded push's deliveries share this channel from several threads),
        so each is shut down on close only."""
        self._pool_lock = threading.Lock()
        self.sender_id = f"{socket.gethostname()}:{id(self):x}"

    def link(self, address: str) -> Link:
        return self._links[address]

    # --- the conversation -----------------------------------------------------------------------

    def connect(self, addresses: Sequence[str]) -> tuple[dict[str, Welcome], Failures]:
        """Connect every receiver without a live link (keeping those still connected); returns
        each reachable receiver's Welcome, and why the others failed."""
        welcomes: dict[str, Welcome] = {}
        failures: Failures = {}
        for address in addresses:
            if self._connected(address):
                welcomes[address] = self._welcomes[address]
                continue
            self.drop(address)
            try:
                welcomes[address] = self._welcomes[address] = self._handshake(address)
            except (WeightSyncError, OSError) as exc:
                failures[address] = self.fail(address, exc)
        return welcomes, failures

    def _connected(self, address: str) -> bool:
        link, inbox = self._links.get(address), self._inboxes.get(address)
        # the receiver may have closed it (it restarted, say) before our reader noticed
        return link is not None and inbox is not None and not inbox.closed.is_set() and not link.closed_by_peer()

    def _handshake(self, address: str) -> Welcome:
        link = self._links[address] = self._open_link(address, self.timeout)
        nonce = new_nonce()
        link.send(Hello(PROTOCOL_VERSION, self.sender_id, nonce), self.timeout)
        self._inboxes[address] = _Inbox(link, self.timeout)
        welcome = self.expect(address, Welcome, time.monotonic() + self.timeout)
        if welcome.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                f"receiver speaks protocol {welcome.protocol}, sender {PROTOCOL_VERSION}", transport=self.scheme
            )
        if self._token is None and welcome.proof:  # it answered our nonce: it holds a token, and would refuse us
            self._leave(address, "requires an auth token and this sender holds none")
        if self._token is not None:
            if not proof_matches(self._token, "receiver", nonce, welcome.proof):
                self._leave(
                    address, "holds another auth token than this sender" if welcome.proof else "holds no auth token"
                )
            link.send(Auth(proof(self._token, "sender", welcome.nonce)), self.timeout)
        return welcome

    def _leave(self, address: str, holds: str) -> None:
        """Refuse a receiver over the tokens: tell it why we leave (it logs it; our own proof is
        never sent to it), and raise AuthError."""
        with contextlib.suppress(WeightSyncError):
            self._links[address].send(Abort(-1, f"auth token refused: this receiver {holds}"), self.timeout)
        raise AuthError(
            f"auth token refused: receiver {address} {holds}; give both sides the same token "
            f"(auth_token=, or ${TOKEN_ENV})"
        )

    def offer(self, offer: Offer, live: Sequence[str]) -> Failures:
        """Send the plan; returns the receivers that did not accept it, with why."""

        def send(address: str, link: Link) -> None:
            self._acked[address] = -1
            link.send(offer, self.timeout)

        failures = self.each(live, send)
        deadline = time.monotonic() + self.timeout

        def accepted(address: str, link: Link) -> None:
            accept = self.expect(address, Accept, deadline)
            self._check_version(accept, offer.version)
            self._lends[address] = accept.lends

        return failures | self.each([a for a in live if a not in failures], accepted)

    def commit(self, commit: Commit, live: Sequence[str]) -> tuple[dict[str, Committed], Failures]:
        """Ask every receiver in `live` to commit; returns the reply of each that did (where it
        spent its time, what it now holds), and those that did not, with why."""
        failures = self.each(live, lambda address, link: link.send(commit, self.timeout))
        deadline = time.monotonic() + self.timeout
        replies: dict[str, Committed] = {}

        def confirm(address: str, link: Link) -> None:
            reply = self.reply(address, deadline)
            while isinstance(reply, BucketDone):  # the window's last acks come first
                self._acked[address] = reply.index
                reply = self.reply(address, deadline)
            if not isinstance(reply, Committed):
                raise ProtocolError(f"expected Committed, got {type(reply).__name__}", transport=self.scheme)
            self._check_version(reply, commit.version)
            replies[address] = reply

        failures |= self.each([a for a in live if a not in failures], confirm)
        return replies, failures

    def abort(self, abort: Abort, live: Sequence[str]) -> None:
        """Tell every receiver in `live` the sync is off, and wait until each let go of it. A
        receiver whose link was dropped already has seen it close: nothing to tell."""
        live = [address for address in live if address in self._links]
        self.each(live, lambda address, link: link.send(abort, self.timeout))
        # A receiver ends the link once it has aborted (and released its sync slot). Wait for
        # that close, so that the next push neither finds the receiver still busy nor reads the
        # aborted sync's late acks; then reconnect next time.
        deadline = time.monotonic() + self.timeout
        for address in live:
            inbox = self._inboxes.get(address)
            if inbox is not None:
                inbox.closed.wait(max(0.0, deadline - time.monotonic()))
            self.drop(address)

    def record(self, address: str, content: str) -> None:
        """What `address` holds now that it committed (`Committed.delta_base`): what its Welcome
        would say if it connected again."""
        welcome = self._welcomes.get(address)
        if welcome is not None:
            self._welcomes[address] = msgspec.structs.replace(welcome, delta_base=content)

    def _check_version(self, reply: Accept | Committed, version: int) -> None:
        if reply.version != version:
            raise ProtocolError(f"receiver answered for version {reply.version}, not {version}", transport=self.scheme)

    # --- tools for the data planes ---------------------------------------------------------------

    def wait_acked(self, address: str, index: int, deadline: float) -> None:
        """Wait until `address` acked bucket `index` of this sync (`BucketDone`, sent in order):
        the credit window of a plane whose receivers ack buckets to free the space they used."""
        while self._acked.get(address, -1) < index:
            self._acked[address] = self.expect(address, BucketDone, deadline).index

    def reply(self, address: str, deadline: float) -> Message:
        """The next message from `address`; a `Failed` raises RemoteError."""
        return self._inboxes[address].get(deadline, self._links[address])

    def expect(self, address: str, kind: type[M], deadline: float) -> M:
        """The next message from `address`, which must be a `kind`; a `Failed` raises RemoteError."""
        message = self.reply(address, deadline)
        if not isinstance(message, kind):
            raise ProtocolError(
                f"expected {getattr(kind, '__name__', 'a message')}, got {type(message).__name__}",
                transport=self.scheme,
            )
        return message

    def each(self, live: Sequence[str], action: Callable[[str, Link], None], *, parallel: bool = False) -> Failures:
        """Run `action` for every receiver in `live`; returns those whose action raised, with why
        (their links dropped). With `parallel`, one thread each: for bulk sends, whose cost is
        per receiver, so that N receivers do not take N times as long."""

        def attempt(address: str) -> BaseException | None:
            try:
                action(address, self._links[address])
            except (WeightSyncError, OSError) as exc:
                return exc
            return None

        if parallel and len(live) > 1:
            errors = list(self._executor(len(live)).map(attempt, live))
        else:
            errors = [attempt(address) for address in live]
        return {
            address: self.fail(address, error) for address, error in zip(live, errors, strict=True) if error is not None
        }

    def fail(self, address: str, exc: BaseException) -> WeightSyncError:
        """Drop a receiver's link after `exc`; returns the error to report (its own reason, when it
        sent one before closing)."""
        error = exc if isinstance(exc, WeightSyncError) else PeerClosedError(str(exc), transport=self.scheme)
        inbox = self._inboxes.get(address)
        if inbox is not None and isinstance(error, PeerClosedError):
            inbox.closed.wait(min(CLOSE_GRACE_S, self.timeout))  # it usually said why before closing
            error = inbox.reason() or error
        # info, not a warning: the push reports it (SyncFailed, or the report's outcomes)
        log.info("receiver %s failed: %s", address, error)
        self.drop(address)
        return error

    def closed(self, address: str, timeout: float) -> bool:
        inbox = self._inboxes.get(address)
        return inbox is not None and inbox.closed.wait(timeout)

    def reason(self, address: str) -> RemoteError | None:
        inbox = self._inboxes.get(address)
        return inbox.reason() if inbox is not None else None

    def lends(self, address: str) -> bool:
        """Whether `address`'s last accepted plan had tensors larger than a bucket to lend to its
        sink whole (`Accept.lends`); False until it accepted one."""
        return self._lends.get(address, False)

    def drop(self, address: str) -> None:
        link = self._links.pop(address, None)
        self._inboxes.pop(address, None)
        self._welcomes.pop(address, None)
        self._lends.pop(address, None)
        self._acked.pop(address, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for address in list(self._links):
            self.drop(address)
        with self._pool_lock:
            pools, self._pools = self._pools, []
        for _, pool in pools:
            pool.shutdown(wait=True)

    def _executor(self, size: int) -> ThreadPoolExecutor:
        with self._pool_lock:
            if not self._pools or self._pools[-1][0] < size:
                pool = ThreadPoolExecutor(size, thread_name_prefix=f"weightsync-{self.scheme}-send")
                self._pools.append((size, pool))
            return self._pools[-1][1]


# --- the receiver's reads -----------------------------------------------------------------------


def next_message(link: Link, timeout: float) -> Message:
    """The sender's next message within a sync; its `Abort` raises RemoteError."""
    message = link.recv(timeout)
    if isinstance(message, Abort):
        raise RemoteError(f"sender aborted the sync of version {message.version}: {message.reason}")
    return message


def expect_on(link: Link, kind: type[M], timeout: float, what: str = "") -> M:
    """The sender's next message within a sync, which must be a `kind` (ProtocolError otherwise)."""
    message = next_message(link, timeout)
    if not isinstance(message, kind):
        raise ProtocolError(
            f"expected {what or kind.__name__}, got {message!r}"[:200],
            transport=link.transport,
        )
    return message


# --- the receiver's end of the handshake ----------------------------------------------------------


def welcome_sender(link: Link, holds: Callable[[], Welcome], token: str | None, timeout: float) -> Welcome | None:
    """The sender's Hello, answered by the Welcome of what the receiver `holds()`, with a fresh
    challenge and, where the receiver has a `token`, its proof; None when the sender is refused
    (a Hello of another protocol)."""
    hello = link.recv(timeout, HANDSHAKE_FRAME_BYTES)
    if not isinstance(hello, Hello) or hello.protocol != PROTOCOL_VERSION:
        detail = f"expected Hello with protocol {PROTOCOL_VERSION}, got {hello!r}"[:500]
        link.send(Failed(-1, "ProtocolError", detail), timeout)
        return None
    answer = proof(token, "receiver", hello.nonce) if token and hello.nonce else ""
    welcome = msgspec.structs.replace(holds(), nonce=new_nonce(), proof=answer)
    link.send(welcome, timeout)
    return welcome


def first_message(link: Link, welcome: Welcome, token: str | None, timeout: float) -> Message:
    """The sender's first message after `welcome`, past its Auth where `token` requires one (an
    `Abort` of version -1: the sender refused our proof, and left).

    Raises:
        AuthError: the receiver holds a token and the sender did not prove it holds it too (the
            sender heard why).
    """
    # The sender goes on at once. Where a token is required, its next frame must be its small
    # Auth: bound it until it is checked.
    message = link.recv(timeout, MAX_FRAME_BYTES if token is None else HANDSHAKE_FRAME_BYTES)
    if isinstance(message, Abort) and message.version < 0:
        return message
    try:
        if _authenticated(welcome, message, token):
            message = link.recv(None)  # that was the sender's Auth frame
    except AuthError as exc:
        link.send(Failed(-1, "AuthError", str(exc)), timeout)
        raise
    return message


def _authenticated(welcome: Welcome, message: Message, token: str | None) -> bool:
    """True if `message` is the sender's `Auth` (consumed), False if it is an ordinary message;
    AuthError if the receiver holds a token and the sender did not prove it holds it too."""
    if token is None:
        return isinstance(message, Auth)
    if not isinstance(message, Auth) or not proof_matches(token, "sender", welcome.nonce, message.proof):
        raise AuthError(
            "auth token refused: the sender did not prove it holds this receiver's auth token (it has none); "
            f"give the sender the receiver's token (auth_token=, or ${TOKEN_ENV})"
        )
    return True
