"""The start message every engine's workers get, and the receiver stack a worker builds from it.

A trainer (or `weightsync serve`) starts a receiver in every worker of an engine with one
`Start`, the same for every engine; each engine carries it its own way (vLLM: the init info of
`init_weight_transfer_engine`; SGLang: one control tensor through its custom loader), always as
msgspec JSON decoded as exactly this type. A worker then calls `start_receiver`::

    WeightReceiver -> [ControlledSink: rings the server's doorbell, with `bell`] -> the engine's sink
    announce(rendezvous, session, WorkerAddress)        the trainer or server learns its address

The token never travels in a message. It reaches every worker one way: the environment the
engine's processes start in ($WEIGHTSYNC_AUTH_TOKEN), from which each worker's `ReceiverOptions`
resolves it (`Start.options`). Whoever starts the engine puts it there: the user, for an
engine a trainer drives, or `weightsync serve` (`token_inherited`, for the engine's life).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import msgspec

from weightsync.auth import TOKEN_ENV
from weightsync.errors import ConfigError, ProtocolError
from weightsync.options import DEFAULT_TIMEOUT_S, ReceiverOptions, build_options
from weightsync.receiver import WeightReceiver
from weightsync.sink import WeightSink
from weightsync.workers.doorbell import ring
from weightsync.workers.rendezvous import WorkerAddress, announce
from weightsync.workers.sink import ControlledSink, LoraStore

__all__ = ["Start", "start_receiver", "token_inherited"]

log = logging.getLogger(__name__)


class Start(msgspec.Struct, frozen=True, kw_only=True, tag="start"):
    """Start this worker's receiver (a fresh one) and announce it in the rendezvous store."""

    rendezvous: str
    """"HOST:PORT" of the store the trainer (or the server) hosts, where each worker leaves its address."""
    session: str
    """Names this start's keys in the store."""
    transport: str = "shm"
    receiver: dict[str, Any] = msgspec.field(default_factory=dict)
    """Every worker's `ReceiverOptions` as JSON, the token left out (`without_token`): a
    networked receiver (tcp, collective, nixl) listens on its host, worker r on its port + r
    (0: any free port)."""
    bell: str = ""
    """`weightsync serve`'s doorbell socket: the server, not a trainer, runs each round (the
    worker's sink rings the server's control as a push arrives)."""
    staged: bool = False
    """Land each sync in a standby copy in host memory first, where a delta push's patch applies
    (the trainer API sets it with `delta`); with `bell`, generation pauses only for the load."""
    drain_timeout: float = DEFAULT_TIMEOUT_S
    """(with `bell`) seconds the server may take to pause generation for a sync."""
    lora_versions: int = 0
    """(with `bell`) versions of each LoRA adapter held in memory; 0: adapters are refused."""

    def __post_init__(self) -> None:
        if "auth_token" in self.receiver:
            raise ConfigError("a start message carries no token (each worker takes its own from its environment)")

    def options(self, rank: int) -> ReceiverOptions:
        """Worker `rank`'s receiver options: its own port, the token from its environment.

        Raises:
            ConfigError: the options are not a `ReceiverOptions`' (an unknown name, a bad value).
        """
        options = build_options(ReceiverOptions, None, self.receiver)
        return dataclasses.replace(options, port=options.port + rank if options.port else 0)

    def to_json(self) -> dict[str, Any]:
        """This message as JSON values (what an engine's call carries)."""
        json: dict[str, Any] = msgspec.to_builtins(self)
        return json

    @classmethod
    def from_json(cls, value: object) -> Start:
        """The message `to_json` made.

        Raises:
            ProtocolError: `value` is not a start message.
        """
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"not a weightsync start message: {exc}") from exc


def start_receiver(
    start: Start, inner: WeightSink, *, rank: int, weight_bytes: int, loras: LoraStore | None = None
) -> WeightReceiver:
    """Worker `rank`'s receiver over `start`'s transport, landing through `inner` (the engine's
    sink, staged or not), wrapped in a `ControlledSink` under a server; announced in the store.

    Args:
        start: the start message.
        inner: where a sync lands (the engine's own sink).
        rank: this worker's rank among the engine's workers.
        weight_bytes: bytes of the weights a sync carries, in the engine's dtype.
        loras: where LoRA adapters land under a server (None: refused).

    Raises:
        ConfigError: the receiver options are invalid.
        ConnectError: the store could not be reached (the receiver is closed again).
    """
    options = start.options(rank)
    sink = inner
    if start.bell:
        bell = functools.partial(ring, start.bell)
        timeout = options.timeout
        sink = ControlledSink(inner, bell, rank=rank, drain_timeout=start.drain_timeout, timeout=timeout, loras=loras)
    receiver = WeightReceiver(sink, start.transport, options=options).start()
    if isinstance(sink, ControlledSink):
        receiver.watch(sink.observe)
    me = WorkerAddress(address=receiver.address, rank=rank, weight_bytes=weight_bytes)
    try:
        announce(start.rendezvous, start.session, me, timeout=options.timeout)
    except BaseException:
        receiver.close()
        raise
    log.info("weightsync: the receiver of worker %d at %s", rank, receiver.address)
    return receiver


@contextlib.contextmanager
def token_inherited(token: str | None) -> Iterator[None]:
    """Inside: $WEIGHTSYNC_AUTH_TOKEN is `token` (unchanged for None), so the engine's processes
    started here inherit it and their workers' receivers require it. After: as it was."""
    if token is None:
        yield
        return
    before = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = before
