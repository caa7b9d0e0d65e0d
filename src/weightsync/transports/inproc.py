"""In-process transport: sender and receiver in one process (colocated / hybrid mode).

Nothing is serialised and no bucket buffer exists: each piece is copied straight from the source
tensor into the receiver's destination, and a receiver without destinations gets the source
tensors themselves (views, or the cast result) with no copy at all.
"""

from __future__ import annotations

import secrets
import weakref

from weightsync.errors import ConnectError, RemoteError, WeightSyncError
from weightsync.pack import write_piece
from weightsync.sink import Landing
from weightsync.transports.base import BucketItem, Peer, ReceiverTransport, SenderTransport, SyncTarget
from weightsync.types import Abort, Commit, Offer

__all__ = ["InprocReceiver", "InprocSender"]

_LISTENING: weakref.WeakValueDictionary[str, InprocReceiver] = weakref.WeakValueDictionary()


class InprocReceiver(ReceiverTransport):
    name = "inproc"

    def __init__(self, target: SyncTarget, *, host: str, port: int, timeout: float) -> None:
        super().__init__(target, host=host, port=port, timeout=timeout)
        self._address = f"inproc://{secrets.token_hex(8)}"

    @property
    def address(self) -> str:
        return self._address

    def start(self) -> None:
        _LISTENING[self._address] = self

    def close(self) -> None:
        _LISTENING.pop(self._address, None)


class InprocSender(SenderTransport):
    name = "inproc"

    def __init__(self, peers: list[Peer], timeout: float) -> None:
        super().__init__(peers, timeout)
        self._targets: dict[Peer, SyncTarget] = {}
        self._landings: dict[Peer, Landing] = {}

    def connect(self) -> None:
        for peer in self.peers:
            peer.error, peer.welcome = None, None
            receiver = _LISTENING.get(peer.address)
            if receiver is None:
                peer.error = ConnectError(
                    f"no receiver listening at {peer.address} in this process", transport=self.name
                )
                continue
            self._targets[peer] = receiver.target
            peer.welcome = receiver.target.welcome()

    def offer(self, offer: Offer) -> None:
        self._landings = {}
        for peer in self.live():
            try:
                self._landings[peer] = self._targets[peer].begin(offer)
            except WeightSyncError as exc:
                peer.error = exc

    def send_bucket(self, index: int, items: list[BucketItem]) -> None:
        for peer in self.live():
            landing = self._landings[peer]
            try:
                for item in items:
                    self._land(landing, item)
                landing.finish_bucket(index)
            except WeightSyncError as exc:
                self._fail(peer, exc)

    @staticmethod
    def _land(landing: Landing, item: BucketItem) -> None:
        piece = item.piece
        if landing.in_place(piece.tensor):
            write_piece(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes, landing.target(piece))
        elif landing.on_device(piece.tensor):
            write_piece(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes, landing.device_target(piece))
        elif piece.tensor_offset == 0:
            landing.adopt(piece.tensor, item.tensor.detach().to(item.wire_dtype))

    def commit(self, commit: Commit) -> None:
        for peer in self.live():
            try:
                self._targets[peer].commit(self._landings.pop(peer), commit)
                peer.committed = True
            except WeightSyncError as exc:
                peer.error = exc

    def abort(self, abort: Abort) -> None:
        for peer in self.live():
            self._fail(peer, RemoteError(f"sender aborted the sync of version {abort.version}: {abort.reason}"))

    def _fail(self, peer: Peer, exc: WeightSyncError) -> None:
        peer.error = exc
        landing = self._landings.pop(peer, None)
        if landing is not None:
            self._targets[peer].abort(landing, exc)

    def close(self) -> None:
        for peer in list(self._landings):
            self._fail(peer, RemoteError("sender closed during a sync"))
        self._targets.clear()
