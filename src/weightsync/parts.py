"""The joining of a sharded sync: one sync of a plan in parts, fed by several senders, each part
over a connection of its own. `Parts` owns everything the joining decides: which parts of the
sync in progress were offered and committed, each part's shares of the tensors' hashes, the
senders connected, and the parts whose sender left between syncs. Its state changes only in its
methods, under its own lock; each answers with a value, and the receiver acts on it.

The rule, one method a sentence:

- `join`: the first part's offer begins a sync; each other part's offer of the same version,
  plan and adapter joins it, once; an offer that would begin a sync is `Refused` while the
  sender of another part is gone (a part that is offered is gone no more).
- `commit`: a part that committed `Wait`s for the sync to end; the last part to commit gets
  `Complete`, with the content digest combined from every part's shares, and commits for all.
- `leave`: a departure makes the sync in progress `Impossible` when it leaves fewer connected
  senders yet to offer a part than parts missing, and there were enough before it (a sync short
  of senders already waits for them to connect); with none in progress, the part its sender
  offered last is gone, unless a sender passed its handshake since that sender's last sync.
- `arrive`: a sender passed its handshake, and may send any part: no part is gone any more.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from weightsync.checksum import combine_shares
from weightsync.errors import ChecksumError, NegotiationError, PeerClosedError, SinkError, TransferTimeout
from weightsync.messages import Offer, TensorShare

__all__ = ["Complete", "Impossible", "Parts", "Refused", "Sender", "Wait"]

S = TypeVar("S")
"""The receiver's handle on one sync (its landing site); `Parts` only compares it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sender:
    """One connected sender, as its connection's thread keeps it between calls to `Parts`."""

    part: int | None = None
    """The part of a sharded sync it offered last, if any."""
    met: int = -1
    """The handshakes counted as of its last sync (-1: it has not passed its own)."""

    def offering(self, offer: Offer) -> Sender:
        """This sender, once it offered `offer`."""
        return dataclasses.replace(self, part=offer.part if offer.plan.parts else None)


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """The offer is refused before any sync begins: a part's sender left, none came since."""

    error: PeerClosedError


@dataclasses.dataclass(frozen=True, slots=True)
class Complete:
    """Every part committed: commit the sync, for all of them, with `digest` ("" unverified)."""

    digest: str


@dataclasses.dataclass(frozen=True, slots=True)
class Impossible(Generic[S]):
    """A departure left too few senders for the missing parts of `sync`: abort it, for `reason`."""

    sync: S
    version: int
    reason: str


@dataclasses.dataclass(eq=False, slots=True)
class _Sync(Generic[S]):
    """The sharded sync in progress (changed only under the lock of the `Parts` that holds it)."""

    offer: Offer
    sync: S
    joined: set[int]
    shares: dict[int, tuple[TensorShare, ...]] = dataclasses.field(default_factory=dict)
    """Each committed part's shares of the tensors' hashes."""
    digest: str = ""
    """The content digest the sync commits, combined from `shares` once every part committed."""
    ended: bool = False
    error: BaseException | None = None

    def takes(self, offer: Offer) -> bool:
        """Whether `offer` is another part of this sync."""
        first = self.offer
        return (offer.version, offer.plan_id, offer.adapter) == (first.version, first.plan_id, first.adapter)

    def missing(self, parts: set[int]) -> list[int]:
        """The plan's parts not in `parts`."""
        return sorted(set(range(len(self.offer.plan.parts))) - parts)


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Wait(Generic[S]):
    """Other parts have yet to commit: `Parts.wait(this)` for the sync to end."""

    _sync: _Sync[S]
    version: int
    """The version the part's commit named."""


class Parts(Generic[S]):
    """The parts of the sharded sync in progress and the senders connected to feed them.

    Args:
        timeout: seconds a committed part waits for the others (`wait`).
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._lock = threading.Condition()
        """Guards everything below; the parts that wait for the others to commit wait on it."""
        self._current: _Sync[S] | None = None
        self._gone: set[int] = set()
        """Parts whose sender closed its connection between syncs, no sender having arrived since."""
        self._met = 0
        """Handshakes so far: a sender that leaves after another one arrived may have been replaced."""
        self._connected = 0
        """Senders connected now (past their Welcome)."""

    # --- the senders ----------------------------------------------------------------------------

    def connect(self) -> Sender:
        """A sender was welcomed: it counts as connected until it `leave`s."""
        with self._lock:
            self._connected += 1
        return Sender()

    def arrive(self, sender: Sender) -> Sender:
        """`sender` passed its handshake: any part may come again."""
        with self._lock:
            self._gone.clear()
            self._met += 1
            return dataclasses.replace(sender, met=self._met)

    def synced(self, sender: Sender) -> Sender:
        """`sender` finished a sync."""
        with self._lock:
            return dataclasses.replace(sender, met=self._met)

    def leave(self, sender: Sender) -> Impossible[S] | None:
        """`sender`'s connection ended between its syncs (its process died, say); the sync in
        progress this makes impossible, if any."""
        with self._lock:
            self._connected -= 1
            current = self._current
            if current is None:
                if sender.part is not None and sender.met == self._met:  # no sender came since
                    self._gone.add(sender.part)
                return None
            missing = current.missing(current.joined)
            free = self._connected - len(current.joined)  # connected, and yet to offer a part of it
            if not free < len(missing) <= free + 1:  # enough senders are left, or were short already
                return None  # (the senders missing then may still connect: only this departure decides)
        if sender.part in missing:
            reason = f"the sender of part {sender.part} closed its connection before it offered its part"
        else:
            reason = (
                f"a sender closed its connection: parts {missing} of the sync cannot come from {free} other senders"
            )
        return Impossible(current.sync, current.offer.version, reason)

    # --- the sync -------------------------------------------------------------------------------

    def join(self, offer: Offer, begin: Callable[[], S]) -> S | Refused:
        """The sync that `offer`, of a part, goes into: the one in progress it is a part of, or
        a new one `begin()` starts (under the lock: the other parts' offers wait for it).

        Raises:
            NegotiationError: the part was offered twice.
        """
        with self._lock:
            current = self._current
            gone = sorted(self._gone - {offer.part})
            self._gone.discard(offer.part)
            if current is None or not current.takes(offer):
                if gone:
                    why = f"the sender of part {gone[0]} closed its connection; version {offer.version} refused"
                    return Refused(PeerClosedError(why))
                sync = begin()
                self._current = _Sync(offer, sync, {offer.part})
                return sync
            if offer.part in current.joined:
                raise NegotiationError(f"part {offer.part} of version {offer.version} was offered twice")
            current.joined.add(offer.part)
            return current.sync

    def commit(self, sync: S, part: int, shares: tuple[TensorShare, ...], version: int) -> Complete | Wait[S]:
        """Part `part` of `sync` landed and its sender asked to commit, with `shares`.

        Raises:
            SinkError: `sync` ended already.
            ChecksumError: the parts' shares do not combine.
        """
        with self._lock:
            current = self._current
            if current is None or current.sync is not sync:
                raise SinkError(f"version {version}: the sync of this part ended already")
            current.shares[part] = shares
            if len(current.shares) < len(current.offer.plan.parts):
                return Wait(current, version)
            current.digest = _combined(current.shares, version)
            return Complete(current.digest)

    def wait(self, wait: Wait[S]) -> str:
        """Block until the sync ends (bounded); the content digest it committed.

        Raises:
            TransferTimeout: the other parts did not commit in time.
            SinkError: the sync failed.
        """
        current, version = wait._sync, wait.version
        with self._lock:
            if not self._lock.wait_for(lambda: current.ended, self._timeout):
                missing = current.missing(set(current.shares))
                raise TransferTimeout(f"version {version}: parts {missing} did not land in time")
        if current.error is not None:
            raise SinkError(f"version {version} did not commit: {current.error}") from current.error
        return current.digest

    def end(self, sync: S, error: BaseException | None) -> None:
        """`sync` ended (with `error`, if it failed): the parts waiting for it hear how."""
        with self._lock:
            current = self._current
            if current is None or current.sync is not sync:
                return
            self._current = None
            current.ended, current.error = True, error
            self._lock.notify_all()


def _combined(shares: Mapping[int, tuple[TensorShare, ...]], version: int) -> str:
    """The content digest of a sharded sync from every part's shares (checksum.combine_shares);
    "" where no part carried any (the sync was not verified)."""
    carried = [shares[part] for part in sorted(shares) if shares[part]]
    if not carried:
        return ""
    if len(carried) < len(shares):
        missing = sorted(part for part, held in shares.items() if not held)
        raise ChecksumError(f"version {version}: the commits of parts {missing} carry no hashes, the others do")
    return combine_shares(carried)
