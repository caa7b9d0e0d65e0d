"""The transport contract: how a sender reaches its receivers, and how a receiver listens.

A sync is always the same conversation; transports differ only in how it travels and how
bucket bytes get from source to destination:

    sender                                 receiver
      connect ------------ Hello ---------->  (listening since construction)
              <----------- Welcome ---------  max bucket size, committed version
      offer   ------------ Offer(plan) ---->  check plan, sink.begin
              <----------- Accept/Failed ---
      send_bucket  x N  -- bucket bytes --->  land pieces, deliver completed tensors
      commit  ------------ Commit --------->  verify digest, sink.commit
              <----------- Committed/Failed-

`WeightSender` calls each method below from exactly one place; a transport records a failing
receiver on its `Peer` and carries on with the others.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

from weightsync.errors import WeightSyncError
from weightsync.types import Abort, Commit, Message, Offer, Piece, Welcome

if TYPE_CHECKING:
    from weightsync.sink import Landing

__all__ = ["BucketItem", "Peer", "ReceiverTransport", "SenderTransport", "SyncTarget"]


@dataclasses.dataclass(slots=True)
class BucketItem:
    """One piece of a bucket with the source tensor it is cut from."""

    piece: Piece
    tensor: torch.Tensor
    wire_dtype: torch.dtype


@dataclasses.dataclass(eq=False, slots=True)
class Peer:
    """A receiver as the sender sees it during a push."""

    address: str
    welcome: Welcome | None = None
    error: WeightSyncError | None = None
    committed: bool = False

    @property
    def alive(self) -> bool:
        return self.error is None and self.welcome is not None


class SenderTransport(ABC):
    """The sending half of a transport, for every receiver address with its scheme."""

    name: str = ""

    def __init__(self, peers: list[Peer], timeout: float) -> None:
        self.peers = peers
        self.timeout = timeout
        self.checksums: list[int] = []
        """The checksums of this sync's buckets, when it verifies buckets and the transport
        has a wire (inproc has none)."""
        self.tensor_digests: tuple[int, ...] = ()
        """With verify="full", once every bucket was sent: each tensor's hash, in plan order."""

    def live(self) -> list[Peer]:
        return [peer for peer in self.peers if peer.alive]

    @abstractmethod
    def connect(self) -> None:
        """Connect (or reconnect) every peer without a live connection and fill its `welcome`."""

    @abstractmethod
    def offer(self, offer: Offer) -> None:
        """Send the plan and wait for every live peer to accept or fail."""

    @abstractmethod
    def send_bucket(self, index: int, items: list[BucketItem]) -> None:
        """Move bucket `index` to every live peer."""

    @abstractmethod
    def commit(self, commit: Commit) -> None:
        """Ask every live peer to commit and wait for each to confirm or fail."""

    @abstractmethod
    def abort(self, abort: Abort) -> None:
        """Tell every live peer the sync is abandoned."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and buffers; safe to call twice."""


class SyncTarget(Protocol):
    """What a receiving transport drives: the `WeightReceiver`'s state machine."""

    auth_required: bool
    """True when senders must prove a shared token (`authenticate`) before anything else."""

    def welcome(self, sender_nonce: str = "") -> Welcome: ...

    def authenticate(self, welcome: Welcome, message: Message) -> bool: ...

    def begin(self, offer: Offer) -> Landing: ...

    def commit(self, landing: Landing, commit: Commit) -> None: ...

    def abort(self, landing: Landing, error: BaseException) -> None: ...


class ReceiverTransport(ABC):
    """The receiving half: listens from `start()` on and drives a `SyncTarget` per sync."""

    name: str = ""

    def __init__(self, target: SyncTarget, *, host: str, port: int, timeout: float) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.timeout = timeout

    @property
    @abstractmethod
    def address(self) -> str:
        """Where senders connect, e.g. "tcp://127.0.0.1:5555"."""

    @abstractmethod
    def start(self) -> None:
        """Start listening in the background."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening, drop connections, release buffers; safe to call twice."""
