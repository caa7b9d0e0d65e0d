"""What the socket-based transports (shm, tcp, and collective and cudaipc built on them) share:
connections, the sender's inbox per peer, and the receiver's accept loop and sync conversation.

Each transport subclasses `StreamSender` and `StreamReceiver` and supplies only how a socket is
opened and how one bucket's bytes move (`send_bucket` / `receive_bucket`).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from weightsync.auth import new_nonce, proof, proof_matches
from weightsync.checksum import TensorHashes, bucket_checksum
from weightsync.errors import (
    AuthError,
    PeerClosedError,
    ProtocolError,
    RemoteError,
    TransferTimeout,
    WeightSyncError,
)
from weightsync.sink import Landing
from weightsync.transports.base import BucketItem, Peer, ReceiverTransport, SenderTransport
from weightsync.types import (
    PROTOCOL_VERSION,
    Abort,
    Accept,
    Auth,
    Commit,
    Committed,
    Failed,
    Hello,
    Message,
    Offer,
    Welcome,
)
from weightsync.wire import HANDSHAKE_FRAME_BYTES, MAX_FRAME_BYTES, Connection

__all__ = ["StreamReceiver", "StreamSender"]

log = logging.getLogger(__name__)


class _Inbox:
    """Messages a peer sends back to the sender, read by a background thread so the sender can
    wait on several peers with one deadline."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self._timeout = timeout
        self._queue: queue.Queue[Message | WeightSyncError] = queue.Queue()
        self.closed = threading.Event()
        """Set once the connection is gone: the peer closed it, died, or sent garbage."""
        self._thread = threading.Thread(target=self._read, args=(conn,), daemon=True, name="weightsync-inbox")
        self._thread.start()

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                # Wait for data without touching the socket's timeout: the sender thread uses the
                # same socket, and switching it to blocking mode under a send in flight turns
                # that send into EAGAIN. Reads then use the sender's own timeout, unchanged.
                conn.wait_readable()
                self._queue.put(conn.recv(timeout=self._timeout))
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

    def get(self, deadline: float, conn: Connection) -> Message:
        try:
            item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TransferTimeout(
                "peer sent no reply in time", transport=conn.transport, version=conn.version, bucket=conn.bucket
            ) from None
        if isinstance(item, WeightSyncError):
            raise item
        if isinstance(item, Failed):
            raise RemoteError(item.message, kind=item.kind)
        return item


class StreamSender(SenderTransport):
    """Sender side over one stream socket per peer."""

    def __init__(self, peers: list[Peer], timeout: float, auth_token: str | None = None) -> None:
        super().__init__(peers, timeout)
        self._token = auth_token
        self._conns: dict[Peer, Connection] = {}
        self._inboxes: dict[Peer, _Inbox] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self.verify = "off"
        """This sync's verification ("off", "bucket" or "full"), from the offer."""
        self.num_buckets = 0
        self.tensor_hashes = TensorHashes(0)
        self.sender_id = f"{socket.gethostname()}:{id(self):x}"

    def checksum(self, items: list[BucketItem], views: list[np.ndarray]) -> int:
        """The bucket checksum of `views` (the bytes of `items`, in order) when this sync
        verifies, else 0; with verify="full", also feeds each piece to its tensor's hash."""
        if self.verify == "off":
            return 0
        if self.verify == "full":
            for item, view in zip(items, views, strict=True):
                self.tensor_hashes.update(item.piece.tensor, view)
        checksum = bucket_checksum(views)
        self.checksums.append(checksum)
        if self.verify == "full" and len(self.checksums) == self.num_buckets:
            self.tensor_digests = self.tensor_hashes.digests()
        return checksum

    @abstractmethod
    def open_socket(self, address: str) -> socket.socket:
        """A socket connected to `address`."""

    def connect(self) -> None:
        for peer in self.peers:
            conn = self._conns.get(peer)
            if conn is not None and peer.error is None and not self._inboxes[peer].closed.is_set():
                if not conn.closed_by_peer():
                    continue  # still connected from the last push
                # the receiver closed it (it restarted, say) and our reader has not noticed yet
            self._drop(peer)
            peer.error, peer.welcome = None, None
            try:
                conn = Connection(self.open_socket(peer.address), self.name)
                self._conns[peer] = conn
                nonce = new_nonce()
                conn.send(Hello(PROTOCOL_VERSION, self.sender_id, nonce), self.timeout)
                self._inboxes[peer] = _Inbox(conn, self.timeout)
                welcome = self.expect(peer, Welcome, time.monotonic() + self.timeout)
                if welcome.protocol != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"receiver speaks protocol {welcome.protocol}, sender {PROTOCOL_VERSION}", transport=self.name
                    )
                if self._token is not None:
                    if not proof_matches(self._token, "receiver", nonce, welcome.proof):
                        raise AuthError(f"receiver {peer.address} did not prove it holds our auth token")
                    conn.send(Auth(proof(self._token, "sender", welcome.nonce)), self.timeout)
                peer.welcome = welcome
            except (WeightSyncError, OSError) as exc:
                self.fail(peer, exc)

    def connection(self, peer: Peer) -> Connection:
        return self._conns[peer]

    def expect(self, peer: Peer, kind: type, deadline: float) -> Message:
        conn = self._conns[peer]
        message = self._inboxes[peer].get(deadline, conn)
        if not isinstance(message, kind):
            raise ProtocolError(
                f"expected {kind.__name__}, got {type(message).__name__}",
                transport=self.name,
                version=conn.version,
                bucket=conn.bucket,
            )
        return message

    def each(self, action: Callable[[Peer, Connection], None], *, parallel: bool = False) -> None:
        """Run `action` for every live peer; a peer whose action raises is marked failed.

        With `parallel`, the peers' actions run at the same time, one thread each: for bulk
        sends, whose cost is per peer, so that N receivers do not take N times as long.
        """
        peers = self.live()

        def attempt(peer: Peer) -> BaseException | None:
            try:
                action(peer, self._conns[peer])
            except (WeightSyncError, OSError) as exc:
                return exc
            return None

        if parallel and len(peers) > 1:
            if self._pool_size < len(peers):
                self._shutdown_pool()
                self._pool = ThreadPoolExecutor(len(peers), thread_name_prefix=f"weightsync-{self.name}-send")
                self._pool_size = len(peers)
            errors = list(self._pool.map(attempt, peers))  # type: ignore[union-attr]
        else:
            errors = [attempt(peer) for peer in peers]
        for peer, error in zip(peers, errors, strict=True):
            if error is not None:
                self.fail(peer, error)

    def fail(self, peer: Peer, exc: BaseException) -> None:
        peer.error = exc if isinstance(exc, WeightSyncError) else PeerClosedError(str(exc), transport=self.name)
        inbox = self._inboxes.get(peer)
        if inbox is not None and isinstance(peer.error, PeerClosedError):
            # The receiver usually said why before closing: let the inbox read up to the EOF.
            inbox.closed.wait(min(1.0, self.timeout))
            peer.error = inbox.reason() or peer.error
        log.warning("receiver %s failed: %s", peer.address, peer.error)
        self._drop(peer)

    def offer(self, offer: Offer) -> None:
        self.verify = offer.verify
        self.checksums = []
        self.num_buckets = len(offer.plan.buckets)
        self.tensor_hashes = TensorHashes(len(offer.plan.tensors))
        self.tensor_digests = ()

        def send(peer: Peer, conn: Connection) -> None:
            conn.version, conn.bucket = offer.version, None
            conn.send(offer, self.timeout)

        self.each(send)
        deadline = time.monotonic() + self.timeout

        def accepted(peer: Peer, conn: Connection) -> None:
            self._check_version(self.expect(peer, Accept, deadline), offer.version)

        self.each(accepted)

    def commit(self, commit: Commit) -> None:
        self.each(lambda peer, conn: conn.send(commit, self.timeout))
        deadline = time.monotonic() + self.timeout

        def confirm(peer: Peer, conn: Connection) -> None:
            while not isinstance(reply := self.expect(peer, object, deadline), Committed):
                pass  # acks of the last buckets may precede the confirmation
            self._check_version(reply, commit.version)
            peer.committed = True

        self.each(confirm)

    def _check_version(self, reply: Accept | Committed, version: int) -> None:
        if reply.version != version:
            raise ProtocolError(f"receiver answered for version {reply.version}, not {version}", transport=self.name)

    def abort(self, abort: Abort) -> None:
        self.each(lambda peer, conn: conn.send(abort, self.timeout))
        # A receiver ends the connection once it has aborted (and released its sync slot). Wait
        # for that close, so the next push neither finds the receiver still busy nor reads the
        # aborted sync's late acks; then reconnect next time.
        deadline = time.monotonic() + self.timeout
        for peer in self.live():
            self._inboxes[peer].closed.wait(max(0.0, deadline - time.monotonic()))
            self._drop(peer)

    def close(self) -> None:
        for peer in list(self._conns):
            self._drop(peer)
        self._shutdown_pool()

    def _shutdown_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._pool_size = None, 0

    def _drop(self, peer: Peer) -> None:
        conn = self._conns.pop(peer, None)
        self._inboxes.pop(peer, None)
        if conn is not None:
            conn.close()


class StreamReceiver(ReceiverTransport):
    """Receiver side: accepts senders and runs the sync conversation on each connection."""

    def __init__(self, target, *, host: str, port: int, timeout: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(target, host=host, port=port, timeout=timeout)
        self._listener: socket.socket | None = None
        self._conns: set[Connection] = set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @abstractmethod
    def listen(self) -> socket.socket:
        """A bound, listening socket."""

    @abstractmethod
    def receive_bucket(self, conn: Connection, message: Message, index: int, landing: Landing) -> None:
        """Land bucket `index`, announced by `message`, into `landing`."""

    def on_setup(self, conn: Connection, message: Message) -> bool:
        """Handle a transport-specific message between syncs; False if it is not one."""
        return False

    def on_disconnect(self, conn: Connection) -> None:
        """Release what this connection held."""

    def start(self) -> None:
        self._listener = self.listen()
        self._spawn(self._accept_loop, "accept")

    def _spawn(self, target: Callable[..., None], role: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"weightsync-{self.name}-{role}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            conn.close()
        for thread in threads:  # a sync in flight aborts (and tells its sink) before close returns
            if thread is not threading.current_thread():
                thread.join(timeout=self.timeout)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = Connection(sock, self.name)
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, "conn", conn)

    def _serve(self, conn: Connection) -> None:
        try:
            hello = conn.recv(self.timeout, HANDSHAKE_FRAME_BYTES)
            if not isinstance(hello, Hello) or hello.protocol != PROTOCOL_VERSION:
                conn.send(
                    Failed(
                        -1, "ProtocolError", f"expected Hello with protocol {PROTOCOL_VERSION}, got {hello!r}"[:500]
                    ),
                    self.timeout,
                )
                return
            welcome = self.target.welcome(hello.nonce)
            conn.send(welcome, self.timeout)
            # The sender goes on at once. Where a token is required, that next frame must be
            # its small Auth: bound it until it is checked.
            limit = HANDSHAKE_FRAME_BYTES if self.target.auth_required else MAX_FRAME_BYTES
            message: Message | None = conn.recv(self.timeout, limit)
            try:
                if self.target.authenticate(welcome, message):
                    message = None  # that was the sender's Auth frame
            except AuthError as exc:
                conn.send(Failed(-1, "AuthError", str(exc)), self.timeout)
                raise
            while not self._closed.is_set():
                if message is None:
                    message = conn.recv(timeout=None)
                if isinstance(message, Offer):
                    self._sync(conn, message)
                elif not self.on_setup(conn, message):
                    raise ProtocolError(f"unexpected {type(message).__name__} between syncs", transport=self.name)
                message = None
        except WeightSyncError as exc:
            if not self._closed.is_set() and not isinstance(exc, PeerClosedError):
                log.warning("closing connection from sender: %s", exc)
        finally:
            self.on_disconnect(conn)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _sync(self, conn: Connection, offer: Offer) -> None:
        conn.version, conn.bucket = offer.version, None
        try:
            landing = self.target.begin(offer)
        except WeightSyncError as exc:
            conn.send(Failed(offer.version, type(exc).__name__, str(exc)), self.timeout)
            return
        try:
            conn.send(Accept(offer.version), self.timeout)
            self.receive_buckets(conn, landing)
            conn.bucket = None
            commit = self._next(conn, offer.version)
            if not isinstance(commit, Commit):
                raise ProtocolError(
                    f"expected Commit, got {type(commit).__name__}", transport=self.name, version=offer.version
                )
            self.target.commit(landing, commit)
        except BaseException as exc:
            self.target.abort(landing, exc)
            if not isinstance(exc, WeightSyncError):
                raise
            if not isinstance(exc, (PeerClosedError, RemoteError)):
                try:
                    conn.send(Failed(offer.version, type(exc).__name__, str(exc)), self.timeout)
                except WeightSyncError:
                    pass
            raise
        conn.send(Committed(offer.version), self.timeout)

    def receive_buckets(self, conn: Connection, landing: Landing) -> None:
        """Land every bucket of the plan, in order, each announced by its own message."""
        for index in range(len(landing.plan.buckets)):
            conn.bucket = index
            self.receive_bucket(conn, self._next(conn, landing.version), index, landing)

    def _next(self, conn: Connection, version: int) -> Message:
        message = conn.recv(self.timeout)
        if isinstance(message, Abort):
            raise RemoteError(f"sender aborted the sync of version {version}: {message.reason}")
        return message
