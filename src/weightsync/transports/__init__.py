"""Transports, one file each, behind the contract in `base.py`.

| name       | reach                    | how bytes move                                          |
|------------|--------------------------|---------------------------------------------------------|
| inproc     | same process             | source -> destination, one copy (or none)               |
| shm        | same host                | source -> shared ring slot -> each receiver             |
| tcp        | any host                 | source memory -> socket -> destination memory           |
| collective | any hosts, a group       | source -> bucket -> rank 1 -> rank 2 ... (gloo chain)    |
| cudaipc    | same GPU, other process  | source -> GPU ring slot -> each receiver (device copies) |
"""

from __future__ import annotations

from weightsync.errors import ConfigError
from weightsync.transports.base import BucketItem, Peer, ReceiverTransport, SenderTransport, SyncTarget
from weightsync.transports.collective import CollectiveReceiver, CollectiveSender
from weightsync.transports.cudaipc import CudaIpcReceiver, CudaIpcSender
from weightsync.transports.inproc import InprocReceiver, InprocSender
from weightsync.transports.shm import ShmReceiver, ShmSender
from weightsync.transports.tcp import TcpReceiver, TcpSender, parse_tcp_address

__all__ = [
    "RECEIVERS",
    "SENDERS",
    "BucketItem",
    "Peer",
    "ReceiverTransport",
    "SenderTransport",
    "SyncTarget",
    "check_address",
    "scheme_of",
]

SENDERS: dict[str, type[SenderTransport]] = {
    "inproc": InprocSender,
    "shm": ShmSender,
    "tcp": TcpSender,
    "collective": CollectiveSender,
    "cudaipc": CudaIpcSender,
}
RECEIVERS: dict[str, type[ReceiverTransport]] = {
    "inproc": InprocReceiver,
    "shm": ShmReceiver,
    "tcp": TcpReceiver,
    "collective": CollectiveReceiver,
    "cudaipc": CudaIpcReceiver,
}


def scheme_of(address: str) -> str:
    """The transport name an address belongs to: "tcp" for "tcp://127.0.0.1:5555"."""
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in SENDERS:
        raise ConfigError(f"address {address!r} names no known transport; expected one of {sorted(SENDERS)}://...")
    return scheme


def check_address(address: str) -> None:
    """Raise ConfigError unless `address` is well formed for its transport (no I/O)."""
    scheme = scheme_of(address)
    rest = address.partition("://")[2]
    if scheme in ("tcp", "collective"):
        parse_tcp_address(address, scheme)
    elif scheme in ("shm", "cudaipc") and (not rest.startswith("@") or len(rest) < 2):
        raise ConfigError(f"{scheme} address must look like {scheme}://@NAME, got {address!r}")
    elif scheme == "inproc" and not rest:
        raise ConfigError(f"inproc address must look like inproc://NAME, got {address!r}")
