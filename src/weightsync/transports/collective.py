"""Collective transport: each bucket goes down a chain of the group, sender to last receiver.

Each bucket travels 0 -> 1 -> ... -> N through the process group, cut in chunks: rank r receives
chunk j from rank r-1 and forwards it to rank r+1 as soon as it arrived, while chunk j+1 is still
coming. The sender sends every byte once whatever N, every receiver receives it once and forwards
it at most once, and a bucket reaches the last receiver a few chunks after the first (a pipelined
chain, as NCCL broadcasts; gloo's own broadcast is a binomial tree that sends a whole bucket
ceil(log2(N+1)) times in turn). Ranks follow the receivers' hosts, so a chain enters each host once.

Control messages travel over one TCP connection per receiver, exactly as in the tcp transport
(handshake, plan, checksums, commit). The bucket bytes travel by gloo send/recv in a process
group of the sender (rank 0) and the receivers that accepted the plan, formed through a
`TCPStore` the sender hosts. A group lives as long as its membership: when the receivers that
accept a plan differ from the current group's (one joined, died or refused), the sender sends
each a `Group` before the first bucket and everyone builds the new one.

Both sides keep two buckets in flight: the sender packs bucket k+1 while bucket k is on the
wire, a receiver posts bucket k+1 before unpacking bucket k (a thread of its own forwards
chunks meanwhile). A receiver whose sink fails keeps taking part (receiving and forwarding,
discarding what it receives) until the plan ends, so one bad receiver never stalls the others;
a member that dies breaks the chain, the members next to it fail at once (gloo notices a closed
peer), they leave the group, which fails the rest within the timeout, and the next sync forms
a new group.

The store and gloo carry only raw bytes, and the store's keys live under a random prefix sent
over the (authenticated) control connection; neither is authenticated itself, so the hosts must
sit on a trusted network (SECURITY.md).
"""

from __future__ import annotations

import datetime
import queue
import secrets
import socket
import threading
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from weightsync.errors import CollectiveError, ConfigError, ProtocolError, WeightSyncError
from weightsync.pack import write_piece
from weightsync.sink import Landing
from weightsync.transports.base import BucketItem, Peer
from weightsync.transports.tcp import TcpReceiver, TcpSender
from weightsync.types import BucketReady, Group, Message, Offer, Plan
from weightsync.wire import Connection

__all__ = ["CollectiveReceiver", "CollectiveSender"]

BACKEND = "gloo"
MAX_WORLD_SIZE = 4096
WATCH_S = 0.2
"""How often an idle forwarder checks that the sender is still there."""
CHUNK_BYTES = 4 << 20
"""Bytes per message along the chain: small enough that a bucket crosses all hops nearly at
once, large enough that the per-message cost disappears."""


def _new_group(store: dist.Store, prefix: str, rank: int, world_size: int, host: str, timeout: float) -> dist.Backend:
    """A gloo group over `store`, its sockets bound to `host`; blocks until every rank joined."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    try:
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)
    except RuntimeError as exc:  # includes DistStoreError (a timeout waiting for the others)
        raise CollectiveError(
            f"rank {rank} of {world_size} could not form the process group: {_first_line(exc)}", transport="collective"
        ) from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def _bucket_used(plan: Plan, index: int) -> int:
    """Bytes of bucket `index` that carry pieces: what is sent (the last bucket is short)."""
    return max((piece.bucket_offset + piece.nbytes for piece in plan.buckets[index]), default=0)


class _InFlight:
    """A bucket posted along the chain; `wait` returns once this member is done with it (sent,
    or received and forwarded), or raises CollectiveError.

    It lets go of its gloo works as soon as it is settled: a work holds the group's connections
    open, and the error a failed sync leaves behind (with its traceback) must not."""

    def __init__(self, works: list[dist.Work] | Future, member: _Member, bucket: int) -> None:
        self._works: list[dist.Work] | Future | None = works
        self._member = member
        self.bucket = bucket

    def forget(self) -> None:
        self._works = None

    def wait(self) -> None:
        works, self._works = self._works, None
        if works is None:
            return
        timeout = datetime.timedelta(seconds=self._member.timeout)
        work = None
        try:
            if isinstance(works, Future):  # the forwarder's: done once received and passed on
                works = works.result(timeout=self._member.timeout + 1)
            for work in works:
                work.wait(timeout)
            return
        except (RuntimeError, TimeoutError) as exc:
            error = self._member.error(exc, self.bucket)
        del works, work  # not even this frame, kept by the error's traceback, may hold them
        raise error


class _Member:
    """One side's share of a formed group: the gloo group, two bucket buffers and, for a rank
    with a successor, the thread that forwards what arrives.

    `close` drops the group, which closes its connections: a peer blocked on it fails at once
    instead of at its timeout."""

    def __init__(
        self, group: dist.Backend, rank: int, world_size: int, timeout: float, control: Connection | None = None
    ) -> None:
        self._group: dist.Backend | None = group
        self._control = control
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.slots: list[torch.Tensor] = []
        self._forwards: queue.SimpleQueue[tuple[list[dist.Work], list[torch.Tensor], Future] | None] | None = None
        if 0 < rank < world_size - 1:
            self._forwards = queue.SimpleQueue()
            # (the thread reads the group off `self`: a Thread keeps its args until it ends)
            threading.Thread(
                target=self._forward_loop, args=(self._forwards,), daemon=True, name="weightsync-collective-forward"
            ).start()

    def buffers(self, bucket_bytes: int, *, pinned: bool = False) -> list[torch.Tensor]:
        """The two bucket buffers; `pinned` (page-locked, once CUDA tensors take part, so that
        copies between them and a GPU are DMA) is kept once asked for."""
        if not self.slots or self.slots[0].numel() != bucket_bytes or (pinned and not self.slots[0].is_pinned()):
            self.slots = [torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        return self.slots

    def broadcast(self, tensor: torch.Tensor, bucket: int) -> _InFlight:
        """Start passing `tensor` down the chain: rank 0 sends it to rank 1; any other rank
        receives it from the rank before and, if one follows, forwards each chunk on arrival."""
        group = self._group
        if group is None:
            raise CollectiveError("the process group was disbanded", transport="collective", bucket=bucket)
        chunks = list(tensor.split(CHUNK_BYTES)) if tensor.numel() else []
        works: list[dist.Work] = []
        error = None
        try:
            for tag, chunk in enumerate(chunks):
                if self.rank == 0:
                    works.append(group.send([chunk], 1, tag))
                else:
                    works.append(group.recv([chunk], self.rank - 1, tag))
        except RuntimeError as exc:
            error = self.error(exc, bucket)
        if error is not None:
            del group, works  # the error's traceback keeps this frame: it must not keep the group
            raise error
        if self._forwards is None:
            return _InFlight(works, self, bucket)
        receives = works
        forwarded: Future = Future()
        self._forwards.put((receives, chunks, forwarded))
        return _InFlight(forwarded, self, bucket)

    def _forward_loop(self, forwards: queue.SimpleQueue) -> None:
        """Forward each chunk once it arrived, bucket after bucket, until `close`.

        After a failure it lets go of the group at once (and fails what is queued unread), which
        closes this rank's connections: the ranks after it then fail at once too, instead of at
        their timeout."""
        failure = ""
        while True:
            try:
                job = forwards.get(timeout=WATCH_S)
            except queue.Empty:
                # The sender closes our control connection when a sync fails; our own thread
                # may be stuck (a stalled sink), so let go of the group from here.
                if self._group is not None and self._control is not None and self._control.closed_by_peer():
                    self._group, failure = None, "the sender left"
                continue
            if job is None:
                return
            receives, chunks, forwarded = job
            group = self._group
            if group is None:
                forwarded.set_exception(RuntimeError(failure or "the process group was disbanded"))
            elif failure := self._forward(group, receives, chunks, forwarded):
                self._group = None
            del job, receives, chunks, forwarded, group  # hold nothing of the group between buckets

    def _forward(
        self, group: dist.Backend, receives: list[dist.Work], chunks: list[torch.Tensor], forwarded: Future
    ) -> str:
        """Forward one bucket; the error, or "" once every chunk was passed on (and the bucket's
        buffer may be reused). Only this thread holds the works, so that letting go of the group
        here lets go of it for good."""
        deadline = time.monotonic() + self.timeout
        sends: list[dist.Work] = []
        try:
            for tag, (work, chunk) in enumerate(zip(receives, chunks, strict=True)):
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                sends.append(group.send([chunk], self.rank + 1, tag))
            for work in sends:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            # a fresh exception: the original's traceback would keep this frame's works
            forwarded.set_exception(RuntimeError(str(exc)))
            return str(exc) or type(exc).__name__
        forwarded.set_result([])
        return ""

    def error(self, exc: BaseException, bucket: int) -> CollectiveError:
        detail = _first_line(exc)
        lowered = detail.lower()
        if isinstance(exc, TimeoutError) or "timeout" in lowered or "timed out" in lowered:
            why = f"a member stalled past the {self.timeout:g} s timeout"
        elif "closed" in lowered or "reset" in lowered or "broken pipe" in lowered:
            why = "a member's connection closed (it died or left the group)"
        else:
            why = "the group failed"
        return CollectiveError(
            f"transfer of bucket {bucket} failed, {why}: {detail}", transport="collective", bucket=bucket
        )

    def close(self) -> None:
        self._group, self.slots = None, []
        if self._forwards is not None:
            self._forwards.put(None)
            self._forwards = None


class CollectiveSender(TcpSender):
    name = "collective"

    def __init__(self, peers: list[Peer], timeout: float, auth_token: str | None = None) -> None:
        super().__init__(peers, timeout, auth_token)
        self._store: dist.TCPStore | None = None
        self._store_host = ""
        self._member: _Member | None = None
        self._members: list[Connection] = []
        self._in_flight: list[_InFlight | None] = [None, None]
        self._plan: Plan | None = None

    def offer(self, offer: Offer) -> None:
        super().offer(offer)  # the peers still live accepted the plan
        self._plan, self._in_flight = offer.plan, [None, None]
        if offer.plan.buckets and self.live():
            self._form_group()

    def _form_group(self) -> None:
        """Make the live peers (and only them) the group, unless they already are; ranks go
        host by host, so that the chain crosses from one host to the next only once."""
        peers = sorted(self.live(), key=lambda peer: self.connection(peer).sock.getpeername()[0])
        members = [self.connection(peer) for peer in peers]
        if self._member is not None and members == self._members:
            return
        self._disband()
        host = members[0].sock.getsockname()[0]  # our address as the receivers reach us
        if self._store is None or self._store_host != host:
            self._store, self._store_host = _host_store(host, self.timeout), host
        prefix = secrets.token_hex(16)
        for rank, peer in enumerate(peers, start=1):
            message = Group(host, self._store.port, prefix, rank, len(peers) + 1, BACKEND)
            try:
                self.connection(peer).send(message, self.timeout)
            except (WeightSyncError, OSError) as exc:
                self.fail(peer, exc)
        if len(self.live()) != len(peers):
            self._fail_all(CollectiveError("a receiver left while the process group was forming", transport=self.name))
            return
        try:
            group = _new_group(self._store, prefix, 0, len(peers) + 1, host, self.timeout)
        except CollectiveError as exc:
            self._fail_all(exc)
            return
        self._member, self._members = _Member(group, 0, len(peers) + 1, self.timeout), members

    def send_bucket(self, index: int, items: list[BucketItem]) -> None:
        assert self._member is not None and self._plan is not None
        slot = index % 2
        if not self._settle(slot):
            return
        cuda = any(item.tensor.is_cuda for item in items)
        buffer = self._member.buffers(self._plan.bucket_bytes, pinned=cuda)[slot]
        out = buffer.numpy()
        views = []
        for item in items:
            piece = item.piece
            view = out[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
            write_piece(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes, view)
            views.append(view)
        message = BucketReady(index, slot, self.checksum(items, views))

        def announce(peer: Peer, conn: Connection) -> None:
            conn.bucket = index
            conn.send(message, self.timeout)

        self.each(announce)
        if not self.live():
            return
        try:
            self._in_flight[slot] = self._member.broadcast(buffer[: _bucket_used(self._plan, index)], index)
        except CollectiveError as exc:
            self._broken(exc)

    def _settle(self, slot: int) -> bool:
        """Wait for the bucket in flight from `slot`, if any; False if the group broke."""
        posted, self._in_flight[slot] = self._in_flight[slot], None
        if posted is None:
            return True
        try:
            posted.wait()
        except CollectiveError as exc:
            self._broken(exc)
            return False
        return True

    def _broken(self, exc: CollectiveError) -> None:
        """The group failed: every member fails this sync; those whose connection closed too
        are reported as gone, with the reason they gave if any."""
        deadline = time.monotonic() + min(0.5, self.timeout)
        for peer in self.live():
            inbox = self._inboxes.get(peer)
            if inbox is not None and inbox.closed.wait(max(0.0, deadline - time.monotonic())):
                self.fail(peer, inbox.reason() or CollectiveError(f"receiver died during the sync ({exc})"))
        self._fail_all(exc)

    def _fail_all(self, exc: WeightSyncError) -> None:
        for peer in self.live():
            self.fail(peer, exc)
        self._disband()

    def commit(self, commit) -> None:  # type: ignore[no-untyped-def]
        for slot in range(2):
            self._settle(slot)
        super().commit(commit)

    def abort(self, abort) -> None:  # type: ignore[no-untyped-def]
        self._disband()  # receivers waiting on the chain see the group close at once
        super().abort(abort)

    def close(self) -> None:
        self._disband()
        self._store = None
        super().close()

    def _disband(self) -> None:
        self._in_flight = [None, None]
        if self._member is not None:
            self._member.close()
        self._member, self._members = None, []


class CollectiveReceiver(TcpReceiver):
    name = "collective"

    def __init__(self, target, *, host: str, port: int, timeout: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(target, host=host, port=port, timeout=timeout)
        self._members: dict[Connection, _Member] = {}

    def receive_buckets(self, conn: Connection, landing: Landing) -> None:
        plan, version = landing.plan, landing.version
        if not plan.buckets:
            return
        conn.bucket = 0
        message: Message | None = self._next(conn, version)
        if isinstance(message, Group):
            self._join(conn, message)
            message = None
        member = self._members.get(conn)
        if member is None:
            raise ProtocolError("no process group was formed for this sync", transport=self.name, version=version)
        cuda = any(landing.on_device(tensor) for tensor in range(len(plan.tensors)))
        buffers = member.buffers(plan.bucket_bytes, pinned=cuda and torch.cuda.is_available())
        pending: tuple[_InFlight, int] | None = None
        posted: _InFlight | None = None
        failure: WeightSyncError | None = None
        try:
            for index in range(len(plan.buckets)):
                conn.bucket = index
                announced = message if message is not None else self._next(conn, version)
                message = None
                if not isinstance(announced, BucketReady) or announced.index != index:
                    raise ProtocolError(
                        f"expected BucketReady for bucket {index}, got {announced!r}"[:200],
                        transport=self.name,
                        version=version,
                        bucket=index,
                    )
                posted = member.broadcast(buffers[index % 2][: _bucket_used(plan, index)], index)
                if pending is not None:
                    failure = self._land(pending, buffers, landing, failure)
                pending = (posted, announced.checksum)
            if pending is not None:
                failure = self._land(pending, buffers, landing, failure)
        except BaseException as exc:
            for inflight in (posted, pending[0] if pending else None):
                if inflight is not None:
                    inflight.forget()  # the error's traceback must not keep the group's connections
            if isinstance(exc, CollectiveError):
                self._leave(conn)  # the group is broken; the sender forms a new one
            raise
        if failure is not None:
            raise failure

    def _land(
        self,
        pending: tuple[_InFlight, int],
        buffers: list[torch.Tensor],
        landing: Landing,
        failure: WeightSyncError | None,
    ) -> WeightSyncError | None:
        """Wait for a posted bucket and land it; after a local failure, only wait (drain)."""
        posted, checksum = pending
        posted.wait()
        index = posted.bucket
        if failure is not None:
            return failure
        slot = buffers[index % 2].numpy()
        try:
            for piece in landing.plan.buckets[index]:
                landing.land(
                    piece, slot[piece.bucket_offset : piece.bucket_offset + piece.nbytes], pinned=buffers[0].is_pinned()
                )
            landing.finish_bucket(index, checksum)
        except WeightSyncError as exc:
            return exc  # keep receiving and forwarding: the others are not held up
        return None

    def _join(self, conn: Connection, message: Group) -> None:
        if message.backend != BACKEND or not 0 < message.rank < message.world_size <= MAX_WORLD_SIZE:
            raise ProtocolError(f"cannot join {message!r}"[:200], transport=self.name)
        self._leave(conn)
        store = _client_store(message.store_host, message.store_port, self.timeout)
        host = conn.sock.getsockname()[0]  # our address as the sender reaches us
        group = _new_group(store, message.prefix, message.rank, message.world_size, host, self.timeout)
        self._members[conn] = _Member(group, message.rank, message.world_size, self.timeout, conn)

    def on_disconnect(self, conn: Connection) -> None:
        self._leave(conn)

    def _leave(self, conn: Connection) -> None:
        member = self._members.pop(conn, None)
        if member is not None:
            member.close()


def _host_store(host: str, timeout: float) -> dist.TCPStore:
    """A store listening on `host` only (a free port), for the groups' rendezvous."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise ConfigError(f"cannot host the collective rendezvous on {host}: {exc.strerror or exc}") from exc
    port = listener.getsockname()[1]
    # The store takes the listening socket over (and closes it when it goes).
    return dist.TCPStore(
        host,
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )


def _client_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise CollectiveError(
            f"cannot reach the sender's rendezvous at {host}:{port}: {_first_line(exc)}", transport="collective"
        ) from exc
