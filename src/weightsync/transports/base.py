"""The transport contract: a control channel plus a data plane, composed, never inherited.

A sync is always the same conversation; `WeightSender.push` runs the sending half and
`WeightReceiver` the receiving half, each in one loop. A transport supplies only two things:

- how the conversation travels: a `Link` per receiver (socket or in-process, `links.py`);
- how bucket bytes move: a data plane, `SendPlane` on the sender and `ReceivePlane` (one per
  connection) on the receiver: a host ring (shm), a device ring (cudaipc), a socket stream
  (tcp), a gloo chain (collective), a direct copy (inproc).

::

    WeightSender.push                              WeightReceiver (one thread per sender)
      channel.connect ---- Hello --------------->  Welcome (+ the sender's Auth)
      plane.prepare   ---- [Ring, Shared] ------>  plane.on_setup        (between syncs)
      channel.offer   ---- Offer(plan) --------->  begin -> Landing
                      <--- Accept / Failed -----
      plane.begin     <--> [Group, NixlTarget] <-> plane.begin(landing)  (plans with buckets)
      plane.send(k, items)  x N  -- bucket k -->   plane.receive(k, landing)  x N
                      <--- BucketDone(k) -------   (ring, nixl, inproc: the credit window)
      plane.finish                                 plane.finish(landing)
      channel.commit ----- Commit ------------->   commit
                      <--- Committed / Failed --

Every step is called by the two loops, in the open: a plane that needs set-up messages sends
and reads them in `prepare`/`begin`, never hidden inside its first bucket. Each plane method returns what happened to each receiver (`Failures`); the sender holds the
state. A transport declares itself once, as a `TransportSpec` in the registry (`__init__.py`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, TypeVar

from weightsync.errors import WeightSyncError
from weightsync.messages import Message, Plan

if TYPE_CHECKING:
    import torch

    from weightsync.checksum import SyncHashes
    from weightsync.landing import Landing
    from weightsync.pack import BucketItem

__all__ = [
    "Channel",
    "Failures",
    "Link",
    "LinkKind",
    "Listener",
    "PlaneOptions",
    "ReceivePlane",
    "SendPlane",
    "TransportSpec",
]

Failures: TypeAlias = dict[str, WeightSyncError]
"""Receivers (by address) that failed in a step, with why."""

LinkKind: TypeAlias = Literal["unix", "tcp", "inproc"]

M = TypeVar("M", bound=Message)


class Link(Protocol):
    """One control connection, either end: typed messages, every wait bounded. Its errors name
    the transport; the sync loops add the version and bucket (`TransportError.at`)."""

    transport: str

    def send(self, message: Message, timeout: float | None) -> None: ...

    def recv(self, timeout: float | None, max_bytes: int = ...) -> Message: ...

    def wait_readable(self) -> None: ...

    def closed_by_peer(self) -> bool: ...

    def close(self) -> None: ...


class Channel(Protocol):
    """What a send plane uses of the sender's control channel (`control.SenderChannel`): its
    receivers' links, and the conversation's credit window."""

    scheme: str

    def link(self, address: str) -> Link: ...

    def each(self, live: Sequence[str], action: Callable[[str, Link], None], *, parallel: bool = False) -> Failures:
        """Run `action` for every receiver in `live`; those whose action raised, with why."""

    def expect(self, address: str, kind: type[M], deadline: float) -> M:
        """The receiver's next message, which must be a `kind`."""

    def wait_acked(self, address: str, index: int, deadline: float) -> None:
        """Wait until the receiver acked bucket `index` of this sync (`BucketDone`)."""

    def lends(self, address: str) -> bool:
        """Whether the receiver's last `Accept` asked for tensors larger than a bucket whole."""

    def fail(self, address: str, exc: BaseException) -> WeightSyncError:
        """Drop the receiver after `exc`; the error to report (its own reason, if it sent one)."""

    def closed(self, address: str, timeout: float) -> bool:
        """Wait up to `timeout` for the receiver's link to close; whether it did."""

    def reason(self, address: str) -> WeightSyncError | None:
        """The failure the receiver reported before its link closed, if it sent one."""


class Listener(Protocol):
    """Where a receiver accepts links; `serve(link)` runs on a thread per connection."""

    address: str

    def start(self, serve: Callable[[Link], None]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlaneOptions:
    """What a data plane is built with, on either side."""

    timeout: float
    """Seconds any single wait may last."""
    num_slots: int = 2
    """Ring slots (shm, cudaipc): 2 lets packing overlap landing."""
    max_bucket_bytes: int = 0
    """Receiver: the largest bucket it accepts (a ring with larger slots is refused)."""


class SendPlane(ABC):
    """How bucket bytes leave the sender, for every receiver of one transport."""

    reads_held = False
    """Whether `prepare` uses `held` (receivers read those tensors in place: cudaipc). Only then
    does the sender walk a source that holds its tensors before the buckets."""

    def __init__(self, channel: Channel, options: PlaneOptions) -> None:
        self.channel = channel
        self.options = options

    def prepare(self, plan: Plan, live: Sequence[str], held: Sequence[torch.Tensor] = ()) -> Failures:
        """Before `plan` is offered to `live`: what receivers must take between syncs (a ring to
        map, tensors to read in place). `held`: the source's tensors in plan order where the
        source holds them for the whole push (`source.holds_tensors`), else (). Returns the
        receivers that failed."""
        return {}

    def begin(self, plan: Plan, accepted: Sequence[str]) -> Failures:
        """Every receiver in `accepted` took `plan`, which has buckets: this sync's own set-up
        (a group to form, targets to read), mirrored by `ReceivePlane.begin`. Returns the
        receivers that failed."""
        return {}

    @abstractmethod
    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        """Move bucket `index` to every receiver in `live`; feed `hashes` with its bytes as sent."""

    def finish(self, live: Sequence[str]) -> Failures:
        """Every bucket was handed to `send`: wait until it left (before the commit)."""
        return {}

    def abort(self) -> None:
        """The sync is abandoned: drop what is in flight."""
        return None

    def close(self) -> None:
        """Release buffers; safe to call twice."""
        return None


class ReceivePlane(ABC):
    """How bucket bytes reach one receiver from one sender (one per connection)."""

    def __init__(self, link: Link, options: PlaneOptions) -> None:
        self.link = link
        self.options = options

    def on_setup(self, message: Message) -> bool:
        """Take a setup message sent between syncs (a ring to map); False if it is not one."""
        return False

    def begin(self, landing: Landing) -> None:
        """This receiver accepted `landing.plan`, which has buckets: the sync's own set-up, the
        mirror of `SendPlane.begin` (join a group, send a target)."""
        return None

    @abstractmethod
    def receive(self, index: int, landing: Landing) -> None:
        """Land bucket `index` (announced on the link) and finish it (`landing.finish_bucket`)."""

    def finish(self, landing: Landing) -> None:
        """After the last `receive`: land what is still in flight."""
        return None

    def close(self) -> None:
        """Release what this connection held; safe to call twice."""
        return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TransportSpec:
    """A transport, declared once: its name, its link, its two data planes, what it needs."""

    name: str
    """The address scheme: "shm" for "shm://@NAME"."""
    link: LinkKind
    """How the conversation travels: a Unix socket, TCP, or in-process."""
    send_plane: Callable[[Channel, PlaneOptions], SendPlane]
    receive_plane: Callable[[Link, PlaneOptions], ReceivePlane]
    messages: tuple[type[Message], ...] = ()
    """Its own control messages (set-up, bucket announcements), declared in its file: its links
    decode these and the core ones (`messages.CORE_MESSAGES`), nothing else."""
    across_processes: bool = True
    """False for a transport whose receivers live in the sender's process (inproc)."""
    has_wire: bool = True
    """Whether bucket bytes cross a wire that checksums can guard (inproc copies in one process)."""
    needs_cuda: bool = False
    largest_auto_bucket_bytes: int = 64 << 20
    """The most an "auto" bucket size grows to for this transport's receivers (still within
    the memory budget split over the slots): 64 MiB, beyond which a copy is no faster."""
    takes_parts: bool = False
    """Whether it carries the plans of a sharded sync with several senders (`Plan.parts`): its
    planes count buckets per sync, not from 0, and each sender's connection has a plane of its
    own (shm, tcp, inproc, collective: a group per sender)."""
    check: Callable[[str], None] = lambda role: None
    """Raises ConfigError when this process cannot use the transport as `role` ("sender" or
    "receiver"): no CUDA for cudaipc."""

    @property
    def networked(self) -> bool:
        """Whether a receiver listens on a network interface (and must guard it with a token)."""
        return self.link == "tcp"
