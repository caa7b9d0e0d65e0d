"""Shared-memory transport: same host, different processes.

The sender owns a ring of pre-faulted shared-memory slots, one bucket each, created once and
reused across syncs. It writes bucket k into slot k % num_slots while receivers copy bucket k-1
out, and every receiver reads the same slot (written once, read N times). A Unix socket per
receiver carries the control messages and the per-bucket acks that free a slot for reuse.

Segments never outlive a sync's setup: every receiver maps the ring before it accepts a plan, and
the sender unlinks the names right after, so a crash of either side leaves nothing in /dev/shm.
A segment created by a process that died before unlinking is reaped by the next ring.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import time
import weakref
from typing import Any

import numpy as np

from weightsync import hostpin
from weightsync.errors import ConfigError, ConnectError, ProtocolError
from weightsync.pack import write_piece
from weightsync.sink import Landing
from weightsync.transports.base import BucketItem, Peer
from weightsync.transports.stream import StreamReceiver, StreamSender
from weightsync.types import BucketDone, BucketReady, Message, Offer, Piece, Ring
from weightsync.wire import Connection

__all__ = ["ShmReceiver", "ShmRing", "ShmSender", "reap_stale_segments"]

SHM_DIR = "/dev/shm"
MAX_SLOTS = 16
_SEGMENT = re.compile(r"weightsync-(\d+)-[0-9a-f]{12}-\d{1,2}")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_segments() -> list[str]:
    """Unlink weightsync segments whose creating process is gone. Returns the names removed."""
    removed = []
    for name in os.listdir(SHM_DIR):
        match = _SEGMENT.fullmatch(name)
        if match and not _pid_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _unlink(names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


class ShmRing:
    """The sender's slots: `num_slots` shared-memory segments of `slot_bytes` each."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        reap_stale_segments()
        token = secrets.token_hex(6)
        self.names = [f"weightsync-{os.getpid()}-{token}-{i}" for i in range(num_slots)]
        self.slot_bytes = slot_bytes
        self.members: set[Connection] = set()
        """The connections that have mapped this ring; a reconnected peer needs a new ring."""
        self._maps: list[mmap.mmap] = []
        self._unlinker = weakref.finalize(self, _unlink, list(self.names))
        try:
            for name in self.names:
                self._maps.append(self._create(name, slot_bytes))
        except BaseException:
            self.close()
            raise
        self.slots = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self.pinned: bool | None = None
        """Page-locked for CUDA: None until CUDA tensors are packed, then whether it worked."""

    def pin(self) -> None:
        """Page-lock the slots, so that CUDA tensors are packed into them by DMA."""
        self.pinned = hostpin.pin_all(self.slots)

    def announcement(self) -> Message:
        """What tells a receiver how to map this ring."""
        return Ring(tuple(self.names), self.slot_bytes)

    def write(self, slot: int, items: list[BucketItem], *, readback: bool) -> list[np.ndarray]:
        """Pack `items` into slot `slot`; returns their bytes there (for checksums)."""
        if self.pinned is None and any(item.tensor.is_cuda for item in items):
            self.pin()
        out = self.slots[slot]
        views = [out[item.piece.bucket_offset : item.piece.bucket_offset + item.piece.nbytes] for item in items]
        for item, view in zip(items, views, strict=True):
            write_piece(item.tensor, item.wire_dtype, item.piece.tensor_offset, item.piece.nbytes, view)
        return views

    @staticmethod
    def _create(name: str, size: int) -> mmap.mmap:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # fail now with ENOSPC, not later with SIGBUS
            except OSError as exc:
                raise ConfigError(
                    f"cannot reserve {size} bytes in {SHM_DIR}: {exc.strerror}; lower bucket_bytes or grow {SHM_DIR}"
                ) from exc
            region = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            region.madvise(_MADV_POPULATE_WRITE)  # pre-fault: the first sync runs at full speed
        except OSError:
            np.frombuffer(region, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
        return region

    def unlink(self) -> None:
        """Remove the names; mappings stay valid in every process that has them."""
        self._unlinker()

    def close(self) -> None:
        self.unlink()
        if self.pinned:
            hostpin.unpin_all(self.slots)
            self.pinned = None
        self.slots = []
        _unmap(self._maps)
        self._maps = []


class ShmSender(StreamSender):
    name = "shm"

    def __init__(self, peers: list[Peer], timeout: float, num_slots: int = 2, auth_token: str | None = None) -> None:
        super().__init__(peers, timeout, auth_token)
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ConfigError(f"num_slots must be in [1, {MAX_SLOTS}], got {num_slots}")
        self.num_slots = num_slots
        self.ring: Any = None
        """The ring buckets go through (a ShmRing here; a transport built on this one may bring its own)."""
        self._acked: dict[Peer, int] = {}

    def open_socket(self, address: str) -> socket.socket:
        return _connect_unix(address, self.name, self.timeout)

    def offer(self, offer: Offer) -> None:
        live = {self.connection(peer) for peer in self.live()}
        ring = self.ring
        if ring is None or ring.slot_bytes != offer.plan.bucket_bytes or not live <= ring.members:
            if ring is not None:
                ring.close()
            self.ring = ring = self.new_ring(offer.plan.bucket_bytes)
            ring.members = live
            message = ring.announcement()
            self.each(lambda peer, conn: conn.send(message, self.timeout))
        self._acked = {peer: -1 for peer in self.live()}
        try:
            super().offer(offer)  # every peer that accepts has mapped the ring
        finally:
            ring.unlink()

    def new_ring(self, slot_bytes: int) -> ShmRing:
        return ShmRing(self.num_slots, slot_bytes)

    def send_bucket(self, index: int, items: list[BucketItem]) -> None:
        assert self.ring is not None
        slot = index % self.num_slots
        deadline = time.monotonic() + self.timeout
        self.each(lambda peer, conn: self._wait_ack(peer, index - self.num_slots, deadline))
        views = self.ring.write(slot, items, readback=self.verify != "off")
        message = BucketReady(index, slot, self.checksum(items, views))

        def notify(peer: Peer, conn: Connection) -> None:
            conn.bucket = index
            conn.send(message, self.timeout)

        self.each(notify)

    def _wait_ack(self, peer: Peer, index: int, deadline: float) -> None:
        while self._acked.get(peer, -1) < index:
            self._acked[peer] = self.expect(peer, BucketDone, deadline).index  # type: ignore[attr-defined]

    def close(self) -> None:
        super().close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None


class ShmReceiver(StreamReceiver):
    name = "shm"

    def __init__(self, target, *, host: str, port: int, timeout: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(target, host=host, port=port, timeout=timeout)
        self._socket_name = f"weightsync-{os.getpid()}-{secrets.token_hex(8)}"
        self._rings: dict[Connection, Any] = {}
        """Each sender's ring as this receiver maps it (a _MappedRing here)."""

    @property
    def address(self) -> str:
        return f"{self.name}://@{self._socket_name}"

    def listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + self._socket_name)  # abstract namespace: nothing to clean up after a crash
        sock.listen(64)
        return sock

    def check_ring(self, num_slots: int, slot_bytes: int) -> None:
        """Refuse a ring this receiver would not allocate buckets for, before mapping any of it."""
        limit = self.target.welcome().max_bucket_bytes
        if not 0 < num_slots <= MAX_SLOTS or not 0 < slot_bytes <= limit:
            raise ProtocolError(
                f"ring of {num_slots} x {slot_bytes} bytes exceeds this receiver's limits", transport=self.name
            )

    def on_setup(self, conn: Connection, message: Message) -> bool:
        if not isinstance(message, Ring):
            return False
        self.check_ring(len(message.segments), message.slot_bytes)
        if not all(_SEGMENT.fullmatch(name) for name in message.segments):
            raise ProtocolError("ring names a segment that is not a weightsync segment", transport=self.name)
        self.on_disconnect(conn)
        self._rings[conn] = _MappedRing([_map_readonly(name, message.slot_bytes) for name in message.segments])
        return True

    def receive_bucket(self, conn: Connection, message: Message, index: int, landing: Landing) -> None:
        ring = self._rings.get(conn)
        if not isinstance(message, BucketReady) or message.index != index:
            raise ProtocolError(
                f"expected BucketReady for bucket {index}, got {message!r}"[:200],
                transport=self.name,
                version=conn.version,
                bucket=index,
            )
        if ring is None or not 0 <= message.slot < len(ring.slots) or landing.plan.bucket_bytes > ring.slot_bytes:
            raise ProtocolError(
                "bucket refers to a ring slot this receiver has not mapped",
                transport=self.name,
                version=conn.version,
                bucket=index,
            )
        ring.read(message.slot, landing.plan.buckets[index], landing)
        landing.finish_bucket(index, message.checksum)
        conn.send(BucketDone(index), self.timeout)

    def on_disconnect(self, conn: Connection) -> None:
        ring = self._rings.pop(conn, None)
        if ring is not None:
            ring.close()
        reap_stale_segments()


class _MappedRing:
    """A receiver's read-only mapping of a sender's ring."""

    def __init__(self, maps: list[mmap.mmap]) -> None:
        self._maps = maps
        self.slots = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        self.slot_bytes = len(maps[0]) if maps else 0
        self.pinned: bool | None = None
        """Page-locked for CUDA: None until a bucket bound for a device arrives, then whether it worked."""

    def pin(self) -> None:
        self.pinned = hostpin.pin_all(self.slots, read_only=True)

    def read(self, slot: int, pieces: list[Piece], landing: Landing) -> None:
        """Land `pieces` out of slot `slot`."""
        if self.pinned is None and any(landing.on_device(piece.tensor) for piece in pieces):
            self.pin()
        out = self.slots[slot]
        for piece in pieces:
            landing.land(piece, out[piece.bucket_offset : piece.bucket_offset + piece.nbytes], pinned=bool(self.pinned))

    def close(self) -> None:
        if self.pinned:
            hostpin.unpin_all(self.slots)
        self.slots = []
        _unmap(self._maps)


def _unmap(maps: list[mmap.mmap]) -> None:
    for region in maps:
        try:
            region.close()
        except BufferError:
            # A view of the slot is still alive (held by the traceback of the error that ended
            # a sync); the mapping goes when that view is collected. The names are unlinked.
            pass


def _map_readonly(name: str, size: int) -> mmap.mmap:
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError as exc:
        raise ProtocolError(f"cannot open ring segment {name}: {exc.strerror}", transport="shm") from exc
    try:
        if os.fstat(fd).st_size != size:
            raise ProtocolError(f"ring segment {name} is not {size} bytes", transport="shm")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _connect_unix(address: str, scheme: str, timeout: float) -> socket.socket:
    prefix = f"{scheme}://@"
    if not address.startswith(prefix):
        raise ConfigError(f"{scheme} address must look like {prefix}NAME, got {address!r}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + address.removeprefix(prefix))
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot reach receiver {address}: {exc.strerror or exc}", transport=scheme) from exc
    return sock
