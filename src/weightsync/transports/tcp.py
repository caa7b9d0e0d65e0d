"""TCP transport: across hosts.

Bucket bytes are streamed straight from the source tensors' memory (`sendall` on views, no
packing copy) and received straight into their landing sites (`recv_into`), so a same-dtype
sync costs no copy in user space on either side; only cast or non-host pieces are packed into a
scratch bucket first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from weightsync.checksum import SyncHashes
from weightsync.errors import ProtocolError
from weightsync.landing import Landing
from weightsync.messages import BucketData
from weightsync.pack import BucketItem, pack_bucket, piece_bytes
from weightsync.transports.base import Failures, Link, PlaneOptions, ReceivePlane, SendPlane, TransportSpec
from weightsync.transports.control import SenderChannel, expect_on
from weightsync.transports.links import socket_link

__all__ = ["SPEC", "StreamReceivePlane", "StreamSendPlane"]


class StreamSendPlane(SendPlane):
    """Each bucket's bytes follow its `BucketData` on the receiver's socket, one thread each."""

    def __init__(self, channel: SenderChannel, options: PlaneOptions) -> None:
        super().__init__(channel, options)
        self._scratch = np.empty(0, dtype=np.uint8)
        """Where pieces that are not plain host bytes (casts, GPU tensors) are packed to be sent."""
        self._scratch_pinned = False

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        views = [self._bytes_of(item) for item in items]
        checksum = hashes.bucket([item.piece for item in items], views) if hashes is not None else 0
        message = BucketData(index, sum(item.piece.nbytes for item in items), checksum)

        def stream(address: str, link: Link) -> None:
            conn = socket_link(link)
            conn.bucket = index
            conn.send(message, self.options.timeout)
            for view in views:
                conn.send_bytes(view, self.options.timeout)

        return self.channel.each(live, stream, parallel=True)

    def _bytes_of(self, item: BucketItem) -> np.ndarray:
        piece = item.piece
        view = piece_bytes(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes)
        if view is not None:
            return view
        end = piece.bucket_offset + piece.nbytes
        pinned = self._scratch_pinned or item.tensor.is_cuda  # page-locked: a GPU copies into it by DMA
        if self._scratch.size < end or pinned != self._scratch_pinned:
            size = max(end, 2 * self._scratch.size)
            self._scratch = torch.empty(size, dtype=torch.uint8, pin_memory=pinned).numpy()
            self._scratch_pinned = pinned
        (packed,) = pack_bucket([item], self._scratch)
        return np.asarray(packed)


class StreamReceivePlane(ReceivePlane):
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
                version=conn.version,
                bucket=index,
            )
        for piece in pieces:
            landing.read_in(piece, lambda out: conn.recv_into(out, self.options.timeout))
        landing.finish_bucket(index, message.checksum)


SPEC = TransportSpec(
    name="tcp",
    link="tcp",
    send_plane=StreamSendPlane,
    receive_plane=StreamReceivePlane,
    summary="any host: source memory -> socket -> destination memory",
)
