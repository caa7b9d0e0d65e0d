"""NIXL transport, the receiving side: what a receiver exposes to the sender's one-sided writes
(`NixlTarget`), how it learns they began (`NixlWrites`), and how it lands what came through a slot.

    receiver, after Accept:  NixlTarget(agent metadata, in-place sites, ring slots)  ->  sender
    receiver, bucket k:      progress its agent until BucketReady(k) (a NixlWrites(k) first, once,
                             when the sender writes into live destinations), copy the slot's
                             pieces into place, finish bucket k  ->  BucketDone(k)

One agent per receiving connection, reused across syncs while what it exposes stays the same:
NIXL refuses to update the keys of memory a peer has loaded, so new memory to expose (a new
bucket size, a destination replaced) means a new agent, which the sender then loads (nixl.py).
"""

from __future__ import annotations

import select
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.errors import ProtocolError, TransferTimeout
from weightsync.landing import Landing
from weightsync.messages import BucketDone, BucketReady, Message
from weightsync.transports.base import Link, PlaneOptions, ReceivePlane
from weightsync.transports.control import next_message
from weightsync.transports.links import socket_link
from weightsync.transports.nixl_agent import NixlAgent, Registered, address_of, collapse_huge_pages, huge_buffer

__all__ = ["COLLAPSE_SHARE", "PROGRESS_S", "NixlReceivePlane", "NixlTarget", "NixlWrites"]

PROGRESS_S = 0.0002
"""How long a waiting receiver sleeps on its control socket between two rounds of NIXL progress:
writes over UCX's tcp transport land only while the receiver progresses (shared memory and RDMA
need nothing from it)."""

COLLAPSE_BEFORE_TARGET_S = 5.0
"""The most a receiver spends, per sync, backing its exposed destinations with huge pages before
it answers with its target (the sender waits for that within its own timeout); what is left is
done at the next syncs. Collapsing ran at about 1 GiB/s here, once per destination."""

COLLAPSE_SHARE = 1.0
"""After its first sync, a side spends at most this share of its previous sync's time backing
memory with huge pages (what is left is done at the next ones): no sync takes much more than
twice the one before it, and the collapse, which pays for itself over the syncs that follow, is
done within a few. On the dev host, 1 GiB of bf16 sources (two runs of 12 syncs each): steady
state (0.19-0.21 s) from the third or fourth sync, the second and third 0.7-1.2 s; with a quarter
it was not reached in 12 (0.27-0.30 s at the twelfth), with a half from the fifth to the seventh."""


class NixlTarget(Message, frozen=True):
    """Receiver -> sender (nixl), right after `Accept`: where the sender may write this sync's
    buckets. Plain bytes and numbers; the sender checks every count against the plan."""

    metadata: bytes
    """The receiver's NIXL agent metadata (how to connect, and the remote keys of the memory it
    registered), opaque bytes loaded by the sender's agent (`add_remote_agent`)."""
    sites: tuple[int, ...]
    """Per plan tensor: the address of its destination's first byte, written in place, or 0 when
    the tensor lands through a slot (it is staged, or lives on a device)."""
    slots: tuple[int, ...]
    """Addresses of the receiver's ring slots of `slot_bytes` each, or () when no piece needs one."""
    slot_bytes: int


class NixlWrites(Message, frozen=True):
    """Sender -> receiver (nixl), just before the sync's first write into an in-place site: from
    bucket `index` on, live destinations may change under the receiver (one-sided writes it does
    not see). A sync that ends before this message leaves them intact."""

    index: int


class _Exposure:
    """What one receiving agent exposes, fixed for the agent's life: destinations written in
    place (`sites`: address -> nbytes) and a ring of `num_slots` slots of `slot_bytes`."""

    def __init__(self, views: Sequence[np.ndarray], num_slots: int, slot_bytes: int, collapse_s: float) -> None:
        self.sites = {address_of(view): view.nbytes for view in views}
        self.slot_bytes = slot_bytes
        ring = huge_buffer(num_slots * slot_bytes) if slot_bytes else None
        self.ring = ring
        self.slots = tuple(address_of(ring) + i * slot_bytes for i in range(num_slots)) if ring is not None else ()
        self._uncollapsed = list(views)
        self.collapse(collapse_s)  # before registering: a NIC pins what is registered
        self.agent = NixlAgent("receiver")
        try:
            self._registered = Registered(self.agent, [*views, *([ring] if ring is not None else [])])
        except BaseException:
            self.agent.close()
            raise
        try:
            self.metadata = self.agent.metadata()
        except BaseException:
            self.close()
            raise

    def collapse(self, budget_s: float) -> None:
        """Back the exposed destinations with huge pages, for at most about `budget_s` (the rest
        at the next sync): the sender's writes into them run about 2.5x faster
        (`collapse_huge_pages`). Done once: they are the engine's, and stay."""
        spent = 0.0
        while self._uncollapsed and spent < budget_s:
            view = self._uncollapsed.pop()
            spent += collapse_huge_pages(address_of(view), view.nbytes)

    def covers(self, sites: Mapping[int, int], slot_bytes: int) -> bool:
        """Whether this exposure already holds `sites` and slots of at least `slot_bytes`."""
        has_slots = slot_bytes == 0 or (bool(self.slots) and self.slot_bytes >= slot_bytes)
        return has_slots and all(self.sites.get(address, -1) >= nbytes for address, nbytes in sites.items())

    def slot(self, slot: int) -> np.ndarray | None:
        if self.ring is None or not 0 <= slot < len(self.slots):
            return None
        return self.ring[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def close(self) -> None:
        try:
            self._registered.close()
        finally:
            self.agent.close()
            self.ring = None


class NixlReceivePlane(ReceivePlane):
    """Exposes this connection's landing sites to the sender's writes, and lands what comes
    through a slot."""

    def __init__(self, link: Link, options: PlaneOptions) -> None:
        super().__init__(link, options)
        self._exposure: _Exposure | None = None
        self._sites: tuple[int, ...] = ()
        """This sync's target: per tensor, the address it lands at in place, or 0."""
        self._started = 0.0
        self._last_sync_s = 0.0
        """How long the previous sync took from its target to its last bucket."""

    def receive(self, index: int, landing: Landing) -> None:
        message = self._await_ready(index, landing)
        pieces = [piece for piece in landing.plan.buckets[index] if piece.nbytes and not self._sites[piece.tensor]]
        if pieces:
            slot = self._exposure.slot(message.slot) if self._exposure is not None else None
            if slot is None:
                raise ProtocolError(
                    f"bucket {index} names slot {message.slot}, which this receiver does not have",
                    transport=self.link.transport,
                    bucket=index,
                )
            for piece in pieces:
                landing.copy_in(piece, slot[piece.bucket_offset : piece.bucket_offset + piece.nbytes])
        landing.finish_bucket(index, message.checksum)
        self.link.send(BucketDone(index), self.options.timeout)
        self._last_sync_s = time.monotonic() - self._started

    def begin(self, landing: Landing) -> None:
        """Expose this sync's landing sites (a new agent when they changed) and send the target."""
        plan = landing.plan
        views = {tensor: site for tensor, site in enumerate(landing.sites()) if site is not None and site.nbytes}
        through_slots = any(piece.nbytes and piece.tensor not in views for bucket in plan.buckets for piece in bucket)
        slot_bytes = plan.bucket_bytes if through_slots else 0
        wanted = {address_of(view): view.nbytes for view in views.values()}
        self._started = time.monotonic()
        collapse_s = min(COLLAPSE_BEFORE_TARGET_S, self.options.timeout / 4)
        if self._exposure is not None and self._exposure.covers(wanted, slot_bytes):
            # what an earlier sync left to do, within a share of a sync
            self._exposure.collapse(min(collapse_s, COLLAPSE_SHARE * self._last_sync_s))
        else:
            exposure = _Exposure(list(views.values()), self.options.num_slots, slot_bytes, collapse_s)
            self.close()
            self._exposure = exposure
        exposure = self._exposure
        self._sites = tuple(address_of(views[t]) if t in views else 0 for t in range(len(plan.tensors)))
        target = NixlTarget(exposure.metadata, self._sites, exposure.slots, exposure.slot_bytes)
        self.link.send(target, self.options.timeout)

    def _await_ready(self, index: int, landing: Landing) -> BucketReady:
        """The sender's BucketReady for bucket `index`, progressing the agent while it comes."""
        conn = socket_link(self.link)
        deadline = time.monotonic() + self.options.timeout
        while True:
            while not _readable(conn.sock, PROGRESS_S):
                if self._exposure is not None:
                    self._exposure.agent.progress()
                if time.monotonic() > deadline:
                    raise TransferTimeout(
                        f"bucket {index} was not written within {self.options.timeout} s",
                        transport=conn.transport,
                        bucket=index,
                    )
            message = next_message(conn, self.options.timeout)
            if isinstance(message, BucketReady) and message.index == index:
                return message
            if not isinstance(message, NixlWrites) or message.index != index:
                raise ProtocolError(
                    f"expected BucketReady for bucket {index}, got {message!r}"[:200],
                    transport=conn.transport,
                    bucket=index,
                )
            for piece in landing.plan.buckets[index]:
                if self._sites[piece.tensor]:  # the sender writes at its target from now on, unseen
                    landing.target(piece)

    def close(self) -> None:
        exposure, self._exposure = self._exposure, None
        if exposure is not None:
            exposure.close()


def _readable(sock: Any, timeout: float) -> bool:
    """Whether a read would not block within `timeout` (a closed socket reads at once: its EOF)."""
    try:
        return bool(select.select([sock], [], [], timeout)[0])
    except (OSError, ValueError):
        return True
