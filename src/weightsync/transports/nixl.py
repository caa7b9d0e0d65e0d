"""NIXL transport: one-sided writes into each receiver's memory, across hosts (RDMA where the
hosts have it: InfiniBand or RoCE, through NIXL's UCX backend).

The conversation travels on a TCP link, as tcp's does; bucket bytes move by NIXL::

    receiver, after Accept:  NixlTarget(agent metadata, in-place sites, ring slots)  ->  loaded
    sender, bucket k:        WRITE every piece: source bytes -> its site, or slot k % num_slots
                             wait until the writes completed (NIXL flushes the endpoint: the
                             bytes are in the receiver's memory), then BucketReady(k, checksum, slot)
    receiver:                copy the slot's pieces into place, finish bucket k  <-  BucketDone(k)

A piece whose source is a plain host tensor of its wire dtype is written straight from the
tensor (registered for the bucket, then released); any other (a cast, a non-contiguous or GPU
tensor) is packed into a registered scratch bucket first. A tensor whose destination is
contiguous host memory is written in place: the receiver exposes it and never copies its bytes.
A staged tensor, or one bound for a device, lands through a ring of slots the receiver owns. So a
plain tensor into an in-place destination costs one copy end to end: the write.

Agents: one per send plane and one per receiving connection, made on first use with NIXL's
progress thread off (it busy-spins a core) and reused across syncs (a receiver that exposes new
memory makes a new agent, which the sender then loads); each side drives progress while it
waits, every wait bounded by the sync's timeout. Registered memory is released on every path.

This file is the sending side and the transport's `SPEC`; the receiving side, with the two
messages it speaks (`NixlTarget`, `NixlWrites`), is nixl_receive.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from weightsync.checksum import SyncHashes
from weightsync.errors import ProtocolError, TransferTimeout, TransportError, WeightSyncError
from weightsync.messages import BucketReady, Plan
from weightsync.pack import BucketItem, pack_bucket, piece_bytes
from weightsync.transports.base import Channel, Failures, Link, PlaneOptions, SendPlane, TransportSpec
from weightsync.transports.nixl_agent import (
    NixlAgent,
    Region,
    Registered,
    address_of,
    close_all,
    collapse_huge_pages,
    huge_buffer,
    live_registrations,
    require_nixl,
)
from weightsync.transports.nixl_receive import COLLAPSE_SHARE, PROGRESS_S, NixlReceivePlane, NixlTarget, NixlWrites
from weightsync.transports.ring import MAX_SLOTS

__all__ = ["SPEC", "NixlSendPlane", "live_registrations"]

log = logging.getLogger(__name__)

IN_PLACE_AHEAD = 8
"""Buckets a sender may write in place ahead of a receiver's last ack: no slot to free, only a
bound on how far it runs ahead (the acks pay a round trip each)."""

AUTO_BUCKET_BYTES = 256 << 20
"""The most an "auto" bucket grows to over nixl (other transports: 64 MiB). Each bucket costs a
fixed 0.5-1 ms of Python on the sender (its sources, its write posted, announced, acked) and
the receiver, and a bucket written in place holds no memory: 4 GiB in 256 MiB buckets took
0.388 s a sync against 0.444 s in 64 MiB ones, one after the other. Still within the memory
budget split over the slots, which is what a slot or the sender's scratch may take."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Peer:
    """A receiver as the sender's agent knows it, and where it takes this sync's buckets."""

    link: Link
    agent: str
    target: NixlTarget
    sites: np.ndarray
    """`target.sites` as uint64, indexed by tensor."""

    def remote_rows(self, index: int, pieces: _Pieces) -> tuple[np.ndarray, int]:
        """Where each piece goes in this receiver (rows of address, nbytes, 0), and the slot."""
        slots = self.target.slots
        slot = index % len(slots) if slots else -1
        sites = self.sites[pieces.tensor]
        through_slot = np.uint64(slots[slot]) + pieces.bucket_offset if slots else np.zeros_like(sites)
        addresses = np.where(sites != 0, sites + pieces.tensor_offset, through_slot)
        return np.stack([addresses, pieces.nbytes, np.zeros_like(addresses)], axis=1), slot

    def in_place(self, pieces: _Pieces) -> bool:
        """Whether any of `pieces` is written into one of this receiver's live destinations."""
        return bool(self.sites[pieces.tensor].any())


@dataclasses.dataclass(frozen=True, slots=True)
class _Pieces:
    """One bucket's non-empty pieces as columns (uint64), with their local bytes' rows."""

    tensor: np.ndarray
    tensor_offset: np.ndarray
    bucket_offset: np.ndarray
    nbytes: np.ndarray
    local: np.ndarray
    """Rows of (address, nbytes, 0) of each piece's bytes on the sender."""

    @classmethod
    def of(cls, items: Sequence[BucketItem], views: Sequence[np.ndarray]) -> _Pieces:
        rows = [(item.piece, view) for item, view in zip(items, views, strict=True) if item.piece.nbytes]

        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.uint64)

        return cls(
            tensor=np.array([piece.tensor for piece, _ in rows], dtype=np.intp),
            tensor_offset=column([piece.tensor_offset for piece, _ in rows]),
            bucket_offset=column([piece.bucket_offset for piece, _ in rows]),
            nbytes=column([piece.nbytes for piece, _ in rows]),
            local=np.array([(address_of(view), view.nbytes, 0) for _, view in rows], dtype=np.uint64).reshape(-1, 3),
        )


def check_target(target: NixlTarget, plan: Plan, transport: str = "nixl") -> None:
    """Refuse a target that does not fit the plan, before anything is written to it."""
    fits = len(target.sites) == len(plan.tensors) and len(target.slots) <= MAX_SLOTS and bool(target.metadata)
    if fits:
        through_slots = any(
            piece.nbytes and not target.sites[piece.tensor] for bucket in plan.buckets for piece in bucket
        )
        fits = not through_slots or (bool(target.slots) and target.slot_bytes >= plan.bucket_bytes)
    if not fits or any(not 0 <= address < 1 << 64 for address in (*target.sites, *target.slots)):
        raise ProtocolError(
            f"the receiver's NIXL target ({len(target.sites)} sites, {len(target.slots)} slots of "
            f"{target.slot_bytes} bytes) does not fit the plan",
            transport=transport,
        )


@dataclasses.dataclass(slots=True)
class _Stranded:
    """Writes still in flight when their receivers were failed, and the memory they read. NIXL
    cannot free a write in flight (UCX touches it when it ends: a double free), so both are
    released only once the writes ended: the receiver caught up, or its connection broke."""

    transfers: dict[str, Any]
    """Receiver agent name -> its unfinished transfer."""
    memory: list[Registered]


_ABANDONED: list[tuple[NixlAgent, list[_Stranded]]] = []
"""Agents closed with writes that never ended (a receiver stopped dead, alive): kept, with the
memory those writes read, for the life of the process rather than freed under UCX."""


class NixlSendPlane(SendPlane):
    """WRITEs every bucket into each receiver's memory through one agent, reused across pushes."""

    def __init__(self, channel: Channel, options: PlaneOptions) -> None:
        super().__init__(channel, options)
        self._agent: NixlAgent | None = None
        self._peers: dict[str, _Peer] = {}
        self._writing: set[str] = set()
        """Receivers told (`NixlWrites`) that this sync writes into their live destinations."""
        self._scratch: np.ndarray | None = None
        """Where pieces that are not plain host bytes are packed; registered with the agent."""
        self._scratch_registered: Registered | None = None
        self._unfinished: dict[str, Any] = {}
        """The bucket being sent: receiver agent -> its write, when it did not complete."""
        self._stranded: list[_Stranded] = []
        self._to_remove: set[str] = set()
        """Receiver agents to unload once no stranded write goes to them."""
        self._sources: tuple[set[Region], set[Region]] = (set(), set())
        """The plain source regions written in the previous push and in this one."""
        self._collapsed: set[Region] = set()
        self._collapse_left_s = 0.0
        self._started = 0.0
        self._last_push_s = 0.0
        """How long the previous push took from setup to its last bucket (bounds the next collapse)."""

    def prepare(self, plan: Plan, live: Sequence[str], held: Sequence[torch.Tensor] = ()) -> Failures:
        try:
            if self._agent is None:
                self._agent = NixlAgent("sender")  # before the offer: its start-up is not the receivers' wait
        except WeightSyncError as exc:
            return dict.fromkeys(live, exc)
        self._forget_gone()
        self._release_stranded(0.0)
        previous, current = self._sources
        self._collapsed &= previous | current
        self._sources = (current, set())
        self._collapse_left_s = min(self.options.timeout / 4, COLLAPSE_SHARE * self._last_push_s)
        self._started = time.monotonic()
        self._writing = set()
        return {}

    def begin(self, plan: Plan, accepted: Sequence[str]) -> Failures:
        """Read every receiver's target for `plan` (`NixlReceivePlane.begin`)."""
        deadline = time.monotonic() + self.options.timeout
        return self.channel.each(accepted, lambda a, link: self._load_target(a, link, plan, deadline))

    def _load_target(self, address: str, link: Link, plan: Plan, deadline: float) -> None:
        """Take the receiver's `NixlTarget` and load its agent (the same agent again is a no-op)."""
        target = self.channel.expect(address, NixlTarget, deadline)
        check_target(target, plan, self.channel.scheme)
        name = self._require_agent().add_remote(target.metadata)
        if any(peer.agent == name for other, peer in self._peers.items() if other != address):
            raise ProtocolError(f"receiver {address} names another receiver's NIXL agent", transport="nixl")
        previous = self._peers.get(address)
        if previous is not None and previous.agent != name:
            self._unload(previous.agent)  # it exposes new memory under a new agent
        self._peers[address] = _Peer(link, name, target, np.array(target.sites, dtype=np.uint64))

    def _forget_gone(self) -> None:
        """Unload the agents of receivers whose links were dropped or replaced since."""
        for address, peer in list(self._peers.items()):
            try:
                current: Link | None = self.channel.link(address)
            except KeyError:
                current = None
            if current is not peer.link:
                del self._peers[address]
                self._unload(peer.agent)

    def _unload(self, name: str) -> None:
        """Disconnect from a receiver's agent, once no stranded write goes to it."""
        if any(name in stranded.transfers for stranded in self._stranded):
            self._to_remove.add(name)
        elif self._agent is not None:
            try:
                self._agent.remove_remote(name)
            except TransportError as exc:
                log.warning("%s", exc)

    def _require_agent(self) -> NixlAgent:
        if self._agent is None:
            raise ProtocolError("bucket sent before the NIXL agent was set up", transport="nixl")
        return self._agent

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        deadline = time.monotonic() + self.options.timeout
        tensors = [item.piece.tensor for item in items if item.piece.nbytes]
        failures = self.channel.each(live, lambda address, link: self._wait_slot(address, index, tensors, deadline))
        views, registered, packed = self._local_bytes(items)
        try:
            checksum = hashes.bucket([item.piece for item in items], views) if hashes is not None else 0
            ready = [address for address in live if address not in failures]
            return failures | self._write(index, _Pieces.of(items, views), ready, checksum, deadline)
        finally:
            self._last_push_s = time.monotonic() - self._started
            memory = [registered] if registered is not None else []
            if self._unfinished:  # what those writes read stays registered, and out of reuse
                if packed and self._scratch_registered is not None:
                    memory.append(self._scratch_registered)
                    self._scratch, self._scratch_registered = None, None
                self._stranded.append(_Stranded(self._unfinished, memory))
                self._unfinished = {}
            else:
                close_all(memory)

    def _wait_slot(self, address: str, index: int, tensors: Sequence[int], deadline: float) -> None:
        """Wait until the receiver freed the slot bucket `index` writes into (a bucket written
        all in place needs none: it only waits not to run more than `IN_PLACE_AHEAD` ahead)."""
        peer = self._peers.get(address)
        if peer is None:
            raise ProtocolError(f"no NIXL target from receiver {address}", transport="nixl")
        through_slot = bool(peer.target.slots) and not peer.sites[tensors].all()
        done = index - (len(peer.target.slots) if through_slot else IN_PLACE_AHEAD)
        self.channel.wait_acked(address, done, deadline)

    def _local_bytes(self, items: Sequence[BucketItem]) -> tuple[list[np.ndarray], Registered | None, bool]:
        """Each piece's bytes in registered host memory: the source's own, or packed in scratch;
        with the sources' registration, and whether any piece was packed."""
        agent = self._require_agent()
        views: list[np.ndarray | None] = [
            piece_bytes(item.tensor, item.wire_dtype, item.piece.tensor_offset, item.piece.nbytes) for item in items
        ]
        plain = [view for view in views if view is not None]
        self._collapse_recurring(plain)
        registered = None
        try:
            registered = Registered(agent, plain)
        except TransportError as exc:  # memory the NIC cannot register (a read-only file mapping): pack it
            log.debug("packing sources NIXL could not register: %s", exc)
            views = [None] * len(items)
        packed = [item for item, view in zip(items, views, strict=True) if view is None]
        if packed:
            scratch = self._scratch_for(max(item.piece.bucket_offset + item.piece.nbytes for item in packed))
            bytes_of = iter(pack_bucket(packed, scratch))
            views = [view if view is not None else np.asarray(next(bytes_of)) for view in views]
        return [view for view in views if view is not None], registered, bool(packed)

    def _collapse_recurring(self, views: Sequence[np.ndarray]) -> None:
        """Back the source bytes that recur push after push (a trainer's own tensors) with huge
        pages, once each, within a time budget per push: writes from them run about 2.5x faster
        (`collapse_huge_pages`). Memory seen for the first time is left alone: a collapse copies
        it, which a buffer gathered afresh for every push would pay every time."""
        previous, current = self._sources
        for view in views:
            region = (address_of(view), view.nbytes)
            current.add(region)
            if region in previous and region not in self._collapsed and self._collapse_left_s > 0:
                self._collapsed.add(region)
                self._collapse_left_s -= collapse_huge_pages(*region)

    def _scratch_for(self, nbytes: int) -> np.ndarray:
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._close_scratch()
            scratch = huge_buffer(nbytes)
            self._scratch_registered = Registered(self._require_agent(), [scratch])
            self._scratch = scratch
        return self._scratch

    def _write(self, index: int, pieces: _Pieces, live: Sequence[str], checksum: int, deadline: float) -> Failures:
        """Post the bucket's writes to every receiver at once (NICs run them side by side), then
        tell each receiver its bucket is there as soon as its write completed."""
        agent = self._require_agent()
        transfers: dict[str, Any] = {}
        states: dict[str, str] = {}
        slots: dict[str, int] = {}

        def post(address: str, link: Link) -> None:
            peer = self._peers[address]
            remote, slots[address] = peer.remote_rows(index, pieces)
            if not len(pieces.local):
                return
            if address not in self._writing and peer.in_place(pieces):
                # before the first write into live memory: a sync that ends sooner left it intact
                link.send(NixlWrites(index), self.options.timeout)
                self._writing.add(address)
            transfers[address], states[address] = agent.post_write(pieces.local, remote, peer.agent)

        def announce_if_done(address: str, link: Link) -> None:
            if address in transfers and not self._done(transfers[address], states, address, link, deadline):
                return
            link.send(BucketReady(index, checksum, slots[address]), self.options.timeout)
            waiting.remove(address)

        try:
            failures = self.channel.each(live, post)
            waiting = [address for address in live if address not in failures]
            while waiting:  # round robin: a slow receiver does not hold up the others' buckets
                failures |= self.channel.each(list(waiting), announce_if_done)
                waiting = [address for address in waiting if address not in failures]
            return failures
        finally:
            for address, transfer in transfers.items():
                if states[address] == "PROC":
                    self._unfinished[self._peers[address].agent] = transfer
                else:
                    agent.release(transfer)

    def _done(self, transfer: Any, states: dict[str, str], address: str, link: Link, deadline: float) -> bool:
        """Whether the write to `address` completed; raises when it failed or ran past `deadline`."""
        if states[address] == "PROC":
            try:
                states[address] = self._require_agent().state(transfer)
            except TransportError:
                states[address] = "ERR"
                raise
        if states[address] == "DONE":
            return True
        if states[address] == "PROC" and time.monotonic() < deadline:
            return False
        raise (TransferTimeout if states[address] == "PROC" else TransportError)(
            f"the write did not complete within {self.options.timeout} s"
            if states[address] == "PROC"
            else "the write failed",
            transport="nixl",
        )

    def _release_stranded(self, wait_s: float) -> None:
        """Release the stranded writes that ended (waiting up to `wait_s` for the rest), then
        unload the receiver agents no stranded write goes to any more."""
        agent = self._agent
        deadline = time.monotonic() + wait_s
        while agent is not None and self._stranded:
            for stranded in list(self._stranded):
                if all(agent.ended(transfer) for transfer in stranded.transfers.values()):
                    for transfer in stranded.transfers.values():
                        agent.release(transfer)
                    close_all(stranded.memory)
                    self._stranded.remove(stranded)
            if time.monotonic() >= deadline:
                break
            time.sleep(PROGRESS_S)
        for name in list(self._to_remove):
            if not any(name in stranded.transfers for stranded in self._stranded):
                self._to_remove.discard(name)
                self._unload(name)

    def close(self) -> None:
        for address in list(self._peers):
            self._unload(self._peers.pop(address).agent)
        self._release_stranded(self.options.timeout if self._stranded else 0.0)
        self._close_scratch()
        agent, self._agent = self._agent, None
        if agent is not None and self._stranded:
            log.warning(
                "nixl: %d write(s) to stalled receivers never ended; their agent and memory are kept for good",
                len(self._stranded),
            )
            _ABANDONED.append((agent, self._stranded))
            self._stranded = []
        elif agent is not None:
            agent.close()

    def _close_scratch(self) -> None:
        registered, self._scratch_registered, self._scratch = self._scratch_registered, None, None
        close_all([registered] if registered is not None else [])


SPEC = TransportSpec(
    name="nixl",
    link="tcp",
    send_plane=NixlSendPlane,
    receive_plane=NixlReceivePlane,
    messages=(NixlTarget, NixlWrites),
    largest_auto_bucket_bytes=AUTO_BUCKET_BYTES,
    check=require_nixl,
)
