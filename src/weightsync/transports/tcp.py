"""TCP transport: across hosts.

Bucket bytes are sent straight from the source tensors' memory (`sendall` on views, no
packing copy) and received straight into their landing sites (`recv_into`), so a same-dtype
sync costs no copy in user space on either side; only cast or non-host pieces are packed into a
scratch bucket first. Without checksums, packing and the wire overlap: a thread sends each
`PACK_CHUNK_BYTES` of the bucket as soon as it is packed, so a cast push moves at the slower of
the cast and the link, not their sum. With checksums the bucket's checksum leads its bytes, so
it is packed whole first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from weightsync.checksum import SyncHashes
from weightsync.errors import ProtocolError, TransferTimeout
from weightsync.landing import Landing
from weightsync.messages import Message
from weightsync.pack import BucketItem, piece_bytes, write_piece
from weightsync.transports.base import Channel, Failures, Link, PlaneOptions, ReceivePlane, SendPlane, TransportSpec
from weightsync.transports.control import expect_on
from weightsync.transports.links import socket_link

__all__ = ["BucketData", "PACK_CHUNK_BYTES", "SPEC", "SocketReceivePlane", "SocketSendPlane"]

PACK_CHUNK_BYTES = 4 << 20
"""Packing hands the sending thread this much at a time: small enough that the link starts at once,
large enough that handing over costs nothing."""


class BucketData(Message, frozen=True):
    """Sender -> receiver (tcp): the raw bytes of bucket `index`'s pieces follow, in plan order."""

    index: int
    nbytes: int
    checksum: int = 0
    """The bucket's checksum (checksum.bucket_checksum) when the sync verifies buckets, else 0."""


class SocketSendPlane(SendPlane):
    """Each bucket's bytes follow its `BucketData` on the receiver's socket, one thread each."""

    def __init__(self, channel: Channel, options: PlaneOptions) -> None:
        super().__init__(channel, options)
        self._scratch = np.empty(0, dtype=np.uint8)
        """Where pieces that are not plain host bytes (casts, GPU tensors) are packed to be sent."""
        self._scratch_pinned = False
        self._thread: ThreadPoolExecutor | None = None
        """Streams a bucket while this thread packs it (`_pack_while_sending`)."""

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        plain = [
            piece_bytes(item.tensor, item.wire_dtype, item.piece.tensor_offset, item.piece.nbytes) for item in items
        ]
        if any(view is None for view in plain):
            self._reserve(items)
            if hashes is None:
                return self._pack_while_sending(index, items, plain, live)
        views = [
            self._pack(item, 0, item.piece.nbytes) if view is None else view
            for item, view in zip(items, plain, strict=True)
        ]
        checksum = hashes.bucket([item.piece for item in items], views) if hashes is not None else 0
        return self._send_bucket(index, items, live, checksum, lambda: iter(views))

    def _send_bucket(
        self,
        index: int,
        items: list[BucketItem],
        live: Sequence[str],
        checksum: int,
        chunks: Callable[[], Iterator[np.ndarray]],
    ) -> Failures:
        """`BucketData`, then the bucket's bytes as `chunks()` yields them, to every receiver."""
        message = BucketData(index, sum(item.piece.nbytes for item in items), checksum)

        def send(address: str, link: Link) -> None:
            conn = socket_link(link)
            conn.send(message, self.options.timeout)
            for chunk in chunks():
                conn.send_bytes(chunk, self.options.timeout)

        return self.channel.each(live, send, parallel=True)

    def _pack_while_sending(
        self, index: int, items: list[BucketItem], plain: list[np.ndarray | None], live: Sequence[str]
    ) -> Failures:
        """Pack the bucket chunk by chunk on this thread while another sends what is packed
        (`plain`: each piece's bytes where they need no packing)."""
        packed = _Packed(self.options.timeout)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightsync-tcp-send")
        sending = self._thread.submit(self._send_bucket, index, items, live, 0, packed.chunks)
        try:
            for item, view in zip(items, plain, strict=True):
                if view is not None:
                    packed.add(view)
                    continue
                for start in range(0, item.piece.nbytes, PACK_CHUNK_BYTES):
                    packed.add(self._pack(item, start, min(PACK_CHUNK_BYTES, item.piece.nbytes - start)))
        except BaseException:
            packed.stop(failed=True)  # each send drops its link: a receiver mid-bucket sees it close
            sending.result()
            raise
        packed.stop()
        return sending.result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _reserve(self, items: list[BucketItem]) -> None:
        """Scratch for every piece of `items` that must be packed, at its bucket offset."""
        end = max(item.piece.bucket_offset + item.piece.nbytes for item in items)
        pinned = self._scratch_pinned or any(item.tensor.is_cuda for item in items)  # a GPU copies into it by DMA
        if self._scratch.size < end or pinned != self._scratch_pinned:
            size = max(end, 2 * self._scratch.size)
            self._scratch = torch.empty(size, dtype=torch.uint8, pin_memory=pinned).numpy()
            self._scratch_pinned = pinned

    def _pack(self, item: BucketItem, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) of a piece, written at their place in the scratch bucket."""
        piece = item.piece
        out = self._scratch[piece.bucket_offset + start : piece.bucket_offset + start + nbytes]
        write_piece(item.tensor, item.wire_dtype, piece.tensor_offset + start, nbytes, out)
        return out


class _Packed:
    """Chunks handed from the packing thread to the sending one, in order."""

    def __init__(self, timeout: float) -> None:
        self._chunks: list[np.ndarray] = []
        self._done = False
        self._failed = False
        self._ready = threading.Condition()
        self._timeout = timeout

    def add(self, chunk: np.ndarray) -> None:
        with self._ready:
            self._chunks.append(chunk)
            self._ready.notify_all()

    def stop(self, failed: bool = False) -> None:
        """No more chunks: all were packed, or packing failed (sends then raise)."""
        with self._ready:
            self._done, self._failed = True, failed
            self._ready.notify_all()

    def chunks(self) -> Iterator[np.ndarray]:
        sent = 0
        while True:
            with self._ready:
                if not self._ready.wait_for(lambda: self._done or len(self._chunks) > sent, self._timeout):  # noqa: B023
                    raise TransferTimeout(f"packing gave nothing for {self._timeout:g} s")
                if self._failed:
                    raise ProtocolError("the sender failed while packing this bucket")
                if sent == len(self._chunks):
                    return
                chunk = self._chunks[sent]
            sent += 1
            yield chunk


class SocketReceivePlane(ReceivePlane):
    """Reads each bucket's bytes off the socket into their landing sites."""

    def receive(self, index: int, landing: Landing) -> None:
        conn = socket_link(self.link)
        pieces = landing.plan.buckets[index]
        expected = sum(piece.nbytes for piece in pieces)
        message = expect_on(conn, BucketData, self.options.timeout, f"BucketData({index}, {expected})")
        if message.index != index or message.nbytes != expected:
            raise ProtocolError(
                f"expected BucketData({index}, {expected}), got {message!r}"[:200],
                transport=conn.transport,
                bucket=index,
            )
        for piece in pieces:
            landing.read_in(piece, lambda out: conn.recv_into(out, self.options.timeout))
        landing.finish_bucket(index, message.checksum)


SPEC = TransportSpec(
    name="tcp",
    link="tcp",
    send_plane=SocketSendPlane,
    receive_plane=SocketReceivePlane,
    messages=(BucketData,),
    takes_parts=True,
)
