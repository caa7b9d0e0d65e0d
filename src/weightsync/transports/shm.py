"""Shared-memory transport: same host, different processes.

The ring protocol (ring.py) with its slots in pre-faulted POSIX shared memory: the sender packs
bucket k into slot k % num_slots, every receiver copies it out into its destinations (by DMA when
they are on a GPU: both sides page-lock the ring then). A Unix socket per receiver carries the
control messages and the per-bucket acks.

Segments never outlive a sync's setup: every receiver maps the ring before it accepts a plan, and
the sender unlinks the names right after, so a crash of either side leaves nothing in /dev/shm.
A segment created by a process that died before unlinking is reaped by the next ring.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref
from collections.abc import Sequence

import numpy as np

from weightsync import hostpin
from weightsync.errors import ProtocolError, ResourceError
from weightsync.landing import Landing
from weightsync.pack import BucketItem, pack_bucket
from weightsync.transports.base import PlaneOptions, TransportSpec
from weightsync.transports.ring import RingReceivePlane, RingSendPlane, check_ring
from weightsync.types import Message, Piece, Ring

__all__ = ["SPEC", "MappedRing", "ShmRing", "reap_stale_segments"]

SHM_DIR = "/dev/shm"
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
        self._maps: list[mmap.mmap] = []
        self._unlinker = weakref.finalize(self, _unlink, list(self.names))
        self.pinned: bool | None = None
        """Page-locked for CUDA: None until CUDA tensors are packed, then whether it worked."""
        try:
            for name in self.names:
                self._maps.append(self._create(name, slot_bytes))
        except BaseException:
            self.close()
            raise
        self.slots = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]

    def pin(self) -> None:
        """Page-lock the slots, so that CUDA tensors are packed into them by DMA."""
        self.pinned = hostpin.pin_all(self.slots)

    def announcement(self) -> Message:
        """What tells a receiver how to map this ring."""
        return Ring(tuple(self.names), self.slot_bytes)

    def write(self, slot: int, items: Sequence[BucketItem], *, readback: bool) -> list[np.ndarray]:
        """Pack `items` into slot `slot`; returns their bytes there (for checksums)."""
        if self.pinned is None and any(item.tensor.is_cuda for item in items):
            self.pin()
        return [np.asarray(view) for view in pack_bucket(items, self.slots[slot])]

    @staticmethod
    def _create(name: str, size: int) -> mmap.mmap:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # fail now with ENOSPC, not later with SIGBUS
            except OSError as exc:
                raise ResourceError(
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


class MappedRing:
    """A receiver's read-only mapping of a sender's ring."""

    def __init__(self, maps: list[mmap.mmap]) -> None:
        self._maps = maps
        self.slots = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        self.slot_bytes = len(maps[0]) if maps else 0
        self.num_slots = len(maps)
        self.pinned: bool | None = None
        """Page-locked for CUDA: None until a bucket bound for a device arrives, then whether it worked."""

    def pin(self) -> None:
        self.pinned = hostpin.pin_all(self.slots, read_only=True)

    def read(self, slot: int, pieces: Sequence[Piece], landing: Landing) -> None:
        """Land `pieces` out of slot `slot`."""
        if self.pinned is None and any(landing.on_device(piece.tensor) for piece in pieces):
            self.pin()
        out = self.slots[slot]
        for piece in pieces:
            data = out[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
            landing.copy_in(piece, data, pinned=bool(self.pinned))

    def close(self) -> None:
        if self.pinned:
            hostpin.unpin_all(self.slots)
        self.slots = []
        _unmap(self._maps)
        reap_stale_segments()  # a sender that died before unlinking its ring left names behind


def open_ring(message: Message, options: PlaneOptions) -> MappedRing | None:
    """Map the ring `message` announces (read-only), or None when it announces none."""
    if not isinstance(message, Ring):
        return None
    check_ring(len(message.segments), message.slot_bytes, options, "shm")
    if not all(_SEGMENT.fullmatch(name) for name in message.segments):
        raise ProtocolError("ring names a segment that is not a weightsync segment", transport="shm")
    ring = MappedRing([_map_readonly(name, message.slot_bytes) for name in message.segments])
    reap_stale_segments()
    return ring


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


SPEC = TransportSpec(
    name="shm",
    link="unix",
    send_plane=lambda channel, options: RingSendPlane(channel, options, ShmRing),
    receive_plane=lambda link, options: RingReceivePlane(link, options, open_ring),
    summary="same host: source -> shared ring slot -> each receiver",
    uses_slots=True,
)
