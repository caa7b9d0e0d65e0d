"""Shared-memory transport: same host, different processes.

The ring protocol (ring.py) with its slots in pre-faulted POSIX shared memory: the sender packs
bucket k into slot k % num_slots, every receiver copies it out into its destinations (by DMA when
they are on a GPU: both sides page-lock the ring then). A Unix socket per receiver carries the
control messages and the per-bucket acks.

A tensor larger than a bucket goes into one more segment, the staging area, whole: a receiver
with a destination copies each piece out as usual, and a receiver whose sink borrows (an
engine's loader) is lent the whole tensor there, so nothing is assembled twice.

Segments never outlive a sync's setup: every receiver maps the ring before it accepts a plan, and
the sender unlinks the names right after, so a crash of either side leaves nothing in /dev/shm.
A segment created by a process that died before unlinking is reaped by the next ring.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

from weightsync import hostpin
from weightsync.errors import ProtocolError, ResourceError
from weightsync.landing import Landing
from weightsync.messages import Message, Piece
from weightsync.pack import BucketItem, write_piece
from weightsync.plan import tensor_nbytes
from weightsync.transports.base import PlaneOptions, TransportSpec
from weightsync.transports.ring import RingReceivePlane, RingSendPlane, Staged, check_ring

__all__ = ["Ring", "SPEC", "MappedRing", "ShmRing", "reap_stale_segments"]

SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"weightsync-(\d+)-[0-9a-f]{12}-\d{1,2}")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Ring(Message, frozen=True):
    """Sender -> receiver (shm only): the shared-memory slots buckets are written to, and the
    staging area tensors larger than a bucket are written to whole ("" and 0: none)."""

    segments: tuple[str, ...]
    slot_bytes: int
    staging: str = ""
    staging_bytes: int = 0


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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


class ShmRing:
    """The sender's slots: `num_slots` shared-memory segments of `slot_bytes` each, and a staging
    area of `staging_bytes` (none when 0)."""

    def __init__(self, num_slots: int, slot_bytes: int, staging_bytes: int = 0) -> None:
        reap_stale_segments()
        token = secrets.token_hex(6)
        self.names = [f"weightsync-{os.getpid()}-{token}-{i}" for i in range(num_slots + bool(staging_bytes))]
        self.slot_bytes = slot_bytes
        self.staging_bytes = staging_bytes
        self._maps: list[mmap.mmap] = []
        self._unlinker = weakref.finalize(self, _unlink, list(self.names))
        self.pinned: bool | None = None
        """Page-locked for CUDA: None until CUDA tensors are packed, then whether it worked."""
        try:
            for i, name in enumerate(self.names):
                self._maps.append(self._create(name, slot_bytes if i < num_slots else staging_bytes))
        except BaseException:
            self.close()
            raise
        regions = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self.slots = regions[:num_slots]
        self.staging = regions[num_slots] if staging_bytes else np.empty(0, dtype=np.uint8)

    def announcement(self) -> Message:
        """What tells a receiver how to map this ring."""
        num_slots = len(self.slots)
        staging = self.names[num_slots] if self.staging_bytes else ""
        return Ring(tuple(self.names[:num_slots]), self.slot_bytes, staging, self.staging_bytes)

    def write(
        self, slot: int, items: Sequence[BucketItem], *, readback: bool, staged: Mapping[int, int]
    ) -> list[np.ndarray]:
        """Pack `items` into slot `slot` (or the staging area); returns their bytes there (for checksums)."""
        if self.pinned is None and any(item.tensor.is_cuda for item in items):
            self.pinned = hostpin.pin_all(_regions(self))  # CUDA tensors are then packed by DMA
        views = []
        for item in items:
            piece, start = item.piece, staged.get(item.piece.tensor)
            if start is None:
                view = self.slots[slot][piece.bucket_offset : piece.bucket_offset + piece.nbytes]
            else:
                view = self.staging[start + piece.tensor_offset : start + piece.tensor_offset + piece.nbytes]
            write_piece(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes, view)
            views.append(view)
        return views

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
            hostpin.unpin_all(_regions(self))
            self.pinned = None
        self.slots = []
        self.staging = np.empty(0, dtype=np.uint8)
        _unmap(self._maps)
        self._maps = []


class MappedRing:
    """A receiver's read-only mapping of a sender's ring (its slots, then its staging area if any)."""

    def __init__(self, maps: list[mmap.mmap], staging: mmap.mmap | None = None) -> None:
        self._maps = maps if staging is None else [*maps, staging]
        self.slots = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        self.staging = np.frombuffer(staging, dtype=np.uint8) if staging is not None else np.empty(0, dtype=np.uint8)
        self.slot_bytes = len(maps[0]) if maps else 0
        self.num_slots = len(maps)
        self.staging_bytes = self.staging.size
        self.pinned: bool | None = None
        """Page-locked for CUDA: None until a bucket bound for a device arrives, then whether it worked."""

    def read(self, slot: int, pieces: Sequence[Piece], landing: Landing, staged: Mapping[int, int]) -> None:
        """Land `pieces` out of slot `slot` (or the staging area)."""
        if self.pinned is None and any(landing.routes[piece.tensor] == "device" for piece in pieces):
            self.pinned = hostpin.pin_all(_regions(self), read_only=True)
        out = self.slots[slot]
        for piece in pieces:
            start = staged.get(piece.tensor)
            if start is None:
                data, whole = out[piece.bucket_offset : piece.bucket_offset + piece.nbytes], None
            else:
                whole = self.staging[start : start + tensor_nbytes(landing.plan.tensors[piece.tensor])]
                data = whole[piece.tensor_offset : piece.tensor_offset + piece.nbytes]
            landing.copy_in(piece, data, pinned=bool(self.pinned), whole=whole)

    def close(self) -> None:
        if self.pinned:
            hostpin.unpin_all(_regions(self))
        self.slots = []
        self.staging = np.empty(0, dtype=np.uint8)
        _unmap(self._maps)
        reap_stale_segments()  # a sender that died before unlinking its ring left names behind


def open_ring(message: Message, options: PlaneOptions) -> MappedRing | None:
    """Map the ring `message` announces (read-only), or None when it announces none."""
    if not isinstance(message, Ring):
        return None
    check_ring(len(message.segments), message.slot_bytes, options, "shm")
    names = [*message.segments, message.staging] if message.staging else list(message.segments)
    if not all(_SEGMENT.fullmatch(name) for name in names) or (message.staging_bytes > 0) != bool(message.staging):
        raise ProtocolError("ring names a segment that is not a weightsync segment", transport="shm")
    maps: list[mmap.mmap] = []
    try:
        for i, name in enumerate(names):
            maps.append(_map_readonly(name, message.slot_bytes if i < len(message.segments) else message.staging_bytes))
    except BaseException:
        _unmap(maps)
        raise
    slots, staging = (maps[:-1], maps[-1]) if message.staging else (maps, None)
    ring = MappedRing(slots, staging)
    reap_stale_segments()
    return ring


def _regions(ring: ShmRing | MappedRing) -> list[np.ndarray]:
    return [*ring.slots, ring.staging] if ring.staging.size else list(ring.slots)


def _unmap(maps: list[mmap.mmap]) -> None:
    for region in maps:
        # A view of the slot may still be alive (held by the traceback of the error that ended
        # a sync); the mapping goes when that view is collected. The names are unlinked.
        with contextlib.suppress(BufferError):
            region.close()


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
    send_plane=lambda channel, options: RingSendPlane(channel, options, ShmRing, stages=True),
    receive_plane=lambda link, options: RingReceivePlane(link, options, open_ring),
    messages=(Ring, Staged),
    takes_parts=True,
)
