"""Collective transport: each bucket goes down a chain of the group, sender to last receiver.

Each bucket travels 0 -> 1 -> ... -> N through the process group, cut in chunks: rank r receives
chunk j from rank r-1 and forwards it to rank r+1 as soon as it arrived, while chunk j+1 is still
coming. The sender sends every byte once whatever N, every receiver receives it once and forwards
it at most once, and a bucket reaches the last receiver a few chunks after the first (a pipelined
chain, as NCCL broadcasts; gloo's own broadcast is a binomial tree that sends a whole bucket
ceil(log2(N+1)) times in turn). Ranks follow the receivers' hosts, so a chain enters each host once.

Control messages travel over one TCP connection per receiver, as in the tcp transport
(handshake, plan, checksums, commit). The bucket bytes travel by gloo send/recv in a process
group of the sender (rank 0) and the receivers that accepted the plan, formed through a
`TCPStore` the sender hosts. A group lives as long as its membership: when the receivers that
accept a plan differ from the current group's (one joined, died or refused), everyone builds a
new one. The sender names the group in a `Group` to each receiver at the start of every sync
with buckets (`begin` on both sides), so a receiver always knows which group carries it.

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
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TypeAlias

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from weightsync.checksum import SyncHashes
from weightsync.errors import CollectiveError, ProtocolError, ResourceError, WeightSyncError
from weightsync.landing import Landing
from weightsync.messages import BucketReady, Message, Plan
from weightsync.pack import BucketItem, pack_bucket
from weightsync.transports.base import (
    Channel,
    Failures,
    Link,
    PlaneOptions,
    ReceivePlane,
    SendPlane,
    TransportSpec,
)
from weightsync.transports.control import expect_on, next_message
from weightsync.transports.links import socket_link

__all__ = ["Group", "SPEC", "ChainReceivePlane", "ChainSendPlane", "host_store"]

log = logging.getLogger(__name__)

BACKEND = "gloo"
MAX_WORLD_SIZE = 4096
WATCH_S = 0.2
"""How often an idle forwarder checks that the sender is still there."""
CHUNK_BYTES = 4 << 20
"""Bytes per message along the chain: small enough that a bucket crosses all hops nearly at
once, large enough that the per-message cost disappears."""


Gloo: TypeAlias = dist.ProcessGroupGloo
Forwarded: TypeAlias = "Future[list[dist.Work]]"
"""Settled once a forwarding rank has received a bucket and passed it on."""
ForwardJob: TypeAlias = "tuple[list[dist.Work], list[torch.Tensor], Forwarded]"
"""What a forwarding rank's thread takes: the receives of a bucket's chunks, the chunks, the result."""


class Group(Message, frozen=True):
    """Sender -> receiver (collective), after `Accept`, before the buckets: the process group
    of this sync. A receiver joins it unless it is a member already (same `prefix`): a new
    group forms when the members that accepted the plan differ from the current group's."""

    store_host: str
    store_port: int
    prefix: str
    """A fresh random key namespace in the sender's store, known only to this group's members."""
    rank: int
    world_size: int
    backend: str


def _send(group: Gloo, chunk: torch.Tensor, peer: int, tag: int) -> dist.Work:
    # ProcessGroupGloo has send/recv at runtime; torch's stubs declare them on ProcessGroup only
    work: dist.Work = group.send([chunk], peer, tag)  # type: ignore[attr-defined]
    return work


def _recv(group: Gloo, chunk: torch.Tensor, peer: int, tag: int) -> dist.Work:
    work: dist.Work = group.recv([chunk], peer, tag)  # type: ignore[attr-defined]
    return work


def _new_group(store: dist.Store, prefix: str, rank: int, world_size: int, host: str, timeout: float) -> Gloo:
    """A gloo group over `store`, its sockets bound to `host`; blocks until every rank joined."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
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

    def __init__(self, works: list[dist.Work] | Forwarded, member: _Member, bucket: int) -> None:
        self._works: list[dist.Work] | Forwarded | None = works
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

    def __init__(self, group: Gloo, rank: int, world_size: int, timeout: float, control: Link | None = None) -> None:
        self._group: Gloo | None = group
        self._control = control
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        self.slots: list[torch.Tensor] = []
        self._forwards: queue.SimpleQueue[ForwardJob | None] | None = None
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
        chunks = list(torch.split(tensor, CHUNK_BYTES)) if tensor.numel() else []
        works: list[dist.Work] = []
        error = None
        try:
            for tag, chunk in enumerate(chunks):
                if self.rank == 0:
                    works.append(_send(group, chunk, 1, tag))
                else:
                    works.append(_recv(group, chunk, self.rank - 1, tag))
        except RuntimeError as exc:
            error = self.error(exc, bucket)
        if error is not None:
            del group, works  # the error's traceback keeps this frame: it must not keep the group
            raise error
        if self._forwards is None:
            return _InFlight(works, self, bucket)
        receives = works
        forwarded: Forwarded = Future()
        self._forwards.put((receives, chunks, forwarded))
        return _InFlight(forwarded, self, bucket)

    def _forward_loop(self, forwards: queue.SimpleQueue[ForwardJob | None]) -> None:
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

    def _forward(self, group: Gloo, receives: list[dist.Work], chunks: list[torch.Tensor], forwarded: Forwarded) -> str:
        """Forward one bucket; the error, or "" once every chunk was passed on (and the bucket's
        buffer may be reused). Only this thread holds the works, so that letting go of the group
        here lets go of it for good."""
        deadline = time.monotonic() + self.timeout
        sends: list[dist.Work] = []
        try:
            for tag, (work, chunk) in enumerate(zip(receives, chunks, strict=True)):
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                sends.append(_send(group, chunk, self.rank + 1, tag))
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


class ChainSendPlane(SendPlane):
    """The sender's end of the chain (rank 0): packs each bucket and passes it to rank 1."""

    def __init__(self, channel: Channel, options: PlaneOptions) -> None:
        super().__init__(channel, options)
        self._store: dist.TCPStore | None = None
        self._store_host = ""
        self._member: _Member | None = None
        self._members: list[Link] = []
        self._in_flight: list[_InFlight | None] = [None, None]
        self._plan: Plan | None = None
        self._invitation = Group("", 0, "", 0, 0, BACKEND)
        """The current group's `Group` message (rank aside), sent at the start of every sync."""

    def begin(self, plan: Plan, accepted: Sequence[str]) -> Failures:
        """Invite every receiver to its group: the current one, or a new one (formed here) when
        the members that accepted `plan` differ. Ranks go host by host, so that the chain
        crosses from one host to the next only once."""
        self._plan, self._in_flight = plan, [None, None]
        ordered = sorted(accepted, key=lambda address: socket_link(self.channel.link(address)).sock.getpeername()[0])
        members = [self.channel.link(address) for address in ordered]
        if self._member is None or members != self._members:
            self._disband()
            host = socket_link(members[0]).sock.getsockname()[0]  # our address as the receivers reach us
            if self._store is None or self._store_host != host:
                self._store, self._store_host = host_store(host, self.options.timeout), host
            self._invitation = Group(host, self._store.port, secrets.token_hex(16), 0, len(ordered) + 1, BACKEND)
        invitation = self._invitation

        def invite(address: str, link: Link) -> None:
            rank = ordered.index(address) + 1
            link.send(msgspec.structs.replace(invitation, rank=rank), self.options.timeout)

        failures = self.channel.each(ordered, invite)
        if failures:
            error = CollectiveError("a receiver left while the process group was forming", transport="collective")
            return failures | self._fail_all([a for a in ordered if a not in failures], error)
        if self._member is None:
            store, world_size = self._store, invitation.world_size
            assert store is not None
            try:
                group = _new_group(store, invitation.prefix, 0, world_size, invitation.store_host, self.options.timeout)
            except CollectiveError as exc:
                return self._fail_all(ordered, exc)
            self._member, self._members = _Member(group, 0, world_size, self.options.timeout), members
            log.info("collective: formed a process group of %d ranks (the sender and its receivers)", world_size)
        return {}

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        member, plan = self._member, self._plan
        if member is None or plan is None:
            return self._fail_all(live, CollectiveError("no process group for this sync", transport="collective"))
        slot = index % 2
        failures = self._settle(slot, live)
        if failures:
            return failures
        buffer = member.buffers(plan.bucket_bytes, pinned=any(item.tensor.is_cuda for item in items))[slot]
        views = [np.asarray(view) for view in pack_bucket(items, buffer.numpy())]
        checksum = hashes.bucket([item.piece for item in items], views) if hashes is not None else 0
        message = BucketReady(index, checksum)
        failures = self.channel.each(live, lambda address, link: link.send(message, self.options.timeout))
        remaining = [address for address in live if address not in failures]
        if not remaining:
            return failures
        try:
            self._in_flight[slot] = member.broadcast(buffer[: _bucket_used(plan, index)], index)
        except CollectiveError as exc:
            return failures | self._broken(exc, remaining)
        return failures

    def finish(self, live: Sequence[str]) -> Failures:
        failures: Failures = {}
        for slot in range(2):
            failures |= self._settle(slot, [a for a in live if a not in failures])
        return failures

    def _settle(self, slot: int, live: Sequence[str]) -> Failures:
        """Wait for the bucket in flight from `slot`, if any; everyone fails if the group broke."""
        posted, self._in_flight[slot] = self._in_flight[slot], None
        if posted is None:
            return {}
        try:
            posted.wait()
        except CollectiveError as exc:
            return self._broken(exc, live)
        return {}

    def _broken(self, exc: CollectiveError, live: Sequence[str]) -> Failures:
        """The group failed: every member fails this sync; those whose link closed too are
        reported as gone, with the reason they gave if any."""
        deadline = time.monotonic() + min(0.5, self.options.timeout)
        failures: Failures = {}
        for address in live:
            if self.channel.closed(address, max(0.0, deadline - time.monotonic())):
                reason = self.channel.reason(address) or CollectiveError(f"receiver died during the sync ({exc})")
                failures[address] = self.channel.fail(address, reason)
        return failures | self._fail_all([a for a in live if a not in failures], exc)

    def _fail_all(self, live: Sequence[str], exc: WeightSyncError) -> Failures:
        failures = {address: self.channel.fail(address, exc) for address in live}
        self._disband()
        return failures

    def abort(self) -> None:
        self._disband()  # receivers waiting on the chain see the group close at once

    def close(self) -> None:
        self._disband()
        self._store = None

    def _disband(self) -> None:
        self._in_flight = [None, None]
        if self._member is not None:
            self._member.close()
        self._member, self._members = None, []


class ChainReceivePlane(ReceivePlane):
    """A receiver's place in the chain: posts bucket k+1 before it lands bucket k, and after a
    local failure keeps receiving and forwarding (discarding) so the others are not held up."""

    def __init__(self, link: Link, options: PlaneOptions) -> None:
        super().__init__(link, options)
        self._member: _Member | None = None
        self._buffers: list[torch.Tensor] = []
        self._pending: tuple[_InFlight, int] | None = None
        self._failure: WeightSyncError | None = None
        self._prefix = ""
        """The key namespace of the group it is a member of."""

    def begin(self, landing: Landing) -> None:
        try:
            invitation = expect_on(self.link, Group, self.options.timeout, "the sync's Group")
            member = self._member
            if member is None or invitation.prefix != self._prefix:
                member = self._join(invitation)
            cuda = "device" in landing.routes and torch.cuda.is_available()
            self._buffers = member.buffers(landing.plan.bucket_bytes, pinned=cuda)
            self._pending, self._failure = None, None
        except BaseException as exc:
            self._forget(exc)
            raise

    def receive(self, index: int, landing: Landing) -> None:
        try:
            member = self._member
            if member is None:
                raise ProtocolError("no process group was formed for this sync", transport="collective")
            announced = next_message(self.link, self.options.timeout)
            if not isinstance(announced, BucketReady) or announced.index != index:
                raise ProtocolError(
                    f"expected BucketReady for bucket {index}, got {announced!r}"[:200],
                    transport="collective",
                    version=landing.version,
                    bucket=index,
                )
            posted = member.broadcast(self._buffers[index % 2][: _bucket_used(landing.plan, index)], index)
            pending, self._pending = self._pending, (posted, announced.checksum)
            if pending is not None:
                self._land(pending, landing)
        except BaseException as exc:
            self._forget(exc)
            raise

    def finish(self, landing: Landing) -> None:
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                self._land(pending, landing)
        except BaseException as exc:
            self._forget(exc)
            raise
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _land(self, pending: tuple[_InFlight, int], landing: Landing) -> None:
        """Wait for a posted bucket and land it; after a local failure, only wait (drain)."""
        posted, checksum = pending
        posted.wait()
        if self._failure is not None:
            return
        index = posted.bucket
        slot = self._buffers[index % 2]
        data = slot.numpy()
        try:
            for piece in landing.plan.buckets[index]:
                piece_data = data[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
                landing.copy_in(piece, piece_data, pinned=slot.is_pinned())
            landing.finish_bucket(index, checksum)
        except WeightSyncError as exc:
            self._failure = exc  # keep receiving and forwarding: the others are not held up

    def _forget(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].forget()  # the error's traceback must not keep the group's connections
        if isinstance(exc, CollectiveError):
            self.close()  # the group is broken; the sender forms a new one

    def _join(self, message: Group) -> _Member:
        if message.backend != BACKEND or not 0 < message.rank < message.world_size <= MAX_WORLD_SIZE:
            raise ProtocolError(f"cannot join {message!r}"[:200], transport="collective")
        self.close()
        timeout = self.options.timeout
        store = _client_store(message.store_host, message.store_port, timeout)
        host = socket_link(self.link).sock.getsockname()[0]  # our address as the sender reaches us
        group = _new_group(store, message.prefix, message.rank, message.world_size, host, timeout)
        self._member = _Member(group, message.rank, message.world_size, timeout, self.link)
        self._prefix = message.prefix
        return self._member

    def close(self) -> None:
        member, self._member = self._member, None
        if member is not None:
            member.close()


def host_store(host: str, timeout: float) -> dist.TCPStore:
    """A store listening on `host` only (a free port), for a rendezvous (TCPStore on its own
    listens on every interface).

    Raises:
        ResourceError: `host` cannot be listened on.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise ResourceError(f"cannot host a rendezvous store on {host}: {exc.strerror or exc}") from exc
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


SPEC = TransportSpec(
    name="collective",
    link="tcp",
    send_plane=ChainSendPlane,
    receive_plane=ChainReceivePlane,
    messages=(Group,),
    takes_parts=True,
)
