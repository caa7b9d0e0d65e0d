"""In-process transport: sender and receiver in one process (colocated / hybrid mode).

The conversation runs over an in-process link (typed messages as objects, no encoding) and no
bucket buffer exists: the receiver takes each bucket's items (the sender's tensors) off the link
and copies every piece straight into its landing site; a tensor without a destination is handed
to the sink as the source tensor itself (a view, or the cast result), with no copy at all. The
sender keeps at most two buckets' items in flight, so a source that gathers tensors one at a
time (FSDP) holds no more than that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from weightsync.checksum import SyncHashes
from weightsync.errors import ProtocolError
from weightsync.landing import IN_PLACE, Landing
from weightsync.messages import BucketDone, BucketReady, Piece, Plan
from weightsync.pack import BucketItem, write_piece
from weightsync.transports.base import Channel, Failures, Link, PlaneOptions, ReceivePlane, SendPlane, TransportSpec
from weightsync.transports.control import expect_on
from weightsync.transports.links import queue_link

__all__ = ["SPEC", "DirectReceivePlane", "DirectSendPlane"]

IN_FLIGHT = 2
"""Buckets handed over and not yet landed, per receiver."""


class DirectSendPlane(SendPlane):
    """Hands each bucket's items to every receiver; waits for the one `IN_FLIGHT` before."""

    def __init__(self, channel: Channel, options: PlaneOptions) -> None:
        super().__init__(channel, options)
        self._sent: list[int] = []
        """The buckets this sync sent (a part of a sharded plan starts past 0)."""

    def prepare(self, plan: Plan, live: Sequence[str], held: Sequence[torch.Tensor] = ()) -> Failures:
        self._sent = []
        return {}

    def send(self, index: int, items: list[BucketItem], live: Sequence[str], hashes: SyncHashes | None) -> Failures:
        deadline = time.monotonic() + self.options.timeout
        after = self._sent[-IN_FLIGHT] if len(self._sent) >= IN_FLIGHT else -1
        self._sent.append(index)

        def hand_over(address: str, link: Link) -> None:
            self.channel.wait_acked(address, after, deadline)
            queue_link(link).hand_over(index, items)
            link.send(BucketReady(index), self.options.timeout)

        return self.channel.each(live, hand_over)


class DirectReceivePlane(ReceivePlane):
    """Copies each piece from the sender's tensor into its landing site (or adopts the tensor)."""

    def receive(self, index: int, landing: Landing) -> None:
        link = queue_link(self.link)
        expect_on(link, BucketReady, self.options.timeout, f"BucketReady for bucket {index}")
        items = link.take_over(index)
        if items is None:
            raise ProtocolError(f"bucket {index} was announced but not handed over", transport="inproc", bucket=index)
        for piece, item in zip(landing.plan.buckets[index], items, strict=True):
            _land(landing, piece, item)
        landing.finish_bucket(index)
        link.send(BucketDone(index), self.options.timeout)


def _land(landing: Landing, piece: Piece, item: BucketItem) -> None:
    """Land `piece` of the plan from `item` (the same piece, cut from the sender's tensor: of a
    sharded plan, its offset is in the part of the tensor that sender holds)."""
    if landing.routes[piece.tensor] in IN_PLACE or landing.plan.parts:
        target = landing.target(piece)
        assert target is not None
        write_piece(item.tensor, item.wire_dtype, item.piece.tensor_offset, piece.nbytes, target)
    elif piece.tensor_offset == 0:
        # the whole tensor, adopted as it is (no copy): its later pieces, if any, are in it already
        landing.adopt(piece.tensor, item.tensor.detach().to(item.wire_dtype))


SPEC = TransportSpec(
    name="inproc",
    link="inproc",
    send_plane=DirectSendPlane,
    receive_plane=DirectReceivePlane,
    across_processes=False,
    has_wire=False,
    takes_parts=True,
)
