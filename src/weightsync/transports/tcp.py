"""TCP transport: across hosts.

Bucket bytes are streamed straight from the source tensors' memory (`sendall` on views, no
packing copy) and received straight into the destination tensors (`recv_into`), so a same-dtype
sync costs no copy in user space on either side; only cast or non-contiguous pieces are packed
into a scratch bucket first.
"""

from __future__ import annotations

import socket

import numpy as np
import torch

from weightsync.errors import ConfigError, ConnectError, ProtocolError
from weightsync.pack import piece_bytes, write_piece
from weightsync.sink import Landing
from weightsync.transports.base import BucketItem, Peer
from weightsync.transports.stream import StreamReceiver, StreamSender
from weightsync.types import BucketData, Message
from weightsync.wire import Connection

__all__ = ["TcpReceiver", "TcpSender", "parse_tcp_address"]


def parse_tcp_address(address: str, scheme: str = "tcp") -> tuple[str, int]:
    """("host", port) from "tcp://host:port" (IPv6 hosts in brackets)."""
    rest = address.removeprefix(f"{scheme}://")
    host, sep, port = rest.rpartition(":")
    if not address.startswith(f"{scheme}://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{scheme} address must look like {scheme}://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket) -> None:
    # Control frames are small and latency-bound. Buffer sizes are left to the kernel's
    # autotuning, which on loopback did as well as any fixed size we tried.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpSender(StreamSender):
    name = "tcp"

    def __init__(self, peers: list[Peer], timeout: float, auth_token: str | None = None) -> None:
        super().__init__(peers, timeout, auth_token)
        self._scratch = np.empty(0, dtype=np.uint8)
        """Where pieces that are not plain host bytes (casts, GPU tensors) are packed to be sent."""
        self._scratch_pinned = False

    def open_socket(self, address: str) -> socket.socket:
        host, port = parse_tcp_address(address, self.name)
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as exc:
            raise ConnectError(f"cannot reach receiver {address}: {exc.strerror or exc}", transport=self.name) from exc
        _tune(sock)
        return sock

    def send_bucket(self, index: int, items: list[BucketItem]) -> None:
        views = [self._bytes_of(item, index) for item in items]
        message = BucketData(index, sum(item.piece.nbytes for item in items), self.checksum(items, views))

        def stream(peer: Peer, conn: Connection) -> None:
            conn.bucket = index
            conn.send(message, self.timeout)
            for view in views:
                conn.send_bytes(view, self.timeout)

        self.each(stream, parallel=True)

    def _bytes_of(self, item: BucketItem, index: int) -> np.ndarray:
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
        out = self._scratch[piece.bucket_offset : end]
        write_piece(item.tensor, item.wire_dtype, piece.tensor_offset, piece.nbytes, out)
        return out


class TcpReceiver(StreamReceiver):
    name = "tcp"

    def __init__(self, target, *, host: str, port: int, timeout: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(target, host=host, port=port, timeout=timeout)
        self._bound: tuple[str, int] | None = None

    @property
    def address(self) -> str:
        if self._bound is None:
            raise ConfigError("receiver is not listening yet")
        host = f"[{self._bound[0]}]" if ":" in self._bound[0] else self._bound[0]
        return f"{self.name}://{host}:{self._bound[1]}"

    def listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(sock)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from exc
        sock.listen(64)
        self._bound = sock.getsockname()[:2]
        return sock

    def receive_bucket(self, conn: Connection, message: Message, index: int, landing: Landing) -> None:
        pieces = landing.plan.buckets[index]
        expected = sum(piece.nbytes for piece in pieces)
        if not isinstance(message, BucketData) or message.index != index or message.nbytes != expected:
            raise ProtocolError(
                f"expected BucketData({index}, {expected}), got {message!r}"[:200],
                transport=self.name,
                version=conn.version,
                bucket=index,
            )
        for piece in pieces:
            landing.fill(piece, lambda out: conn.recv_into(out, self.timeout))
        landing.finish_bucket(index, message.checksum)
