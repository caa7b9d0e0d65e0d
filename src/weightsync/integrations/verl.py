"""verl's checkpoint engine, backed by weightsync: `checkpoint_engine.backend=weightsync`.

verl (0.9.1) moves weights from its trainer (the actor worker group) to its rollout workers through
a `CheckpointEngine` chosen by name in `CheckpointEngineRegistry`, and imports
`checkpoint_engine.custom_backend_module` on every worker before it builds one. Importing this
module registers the backend "weightsync" (docs/integrations/verl.md has the config lines):

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl

How verl's `CheckpointEngineManager` drives it, every sync:

    every worker  prepare()              rollout: listen (the first time) and return the address
    driver        build_topology(...)    actor rank 0 gets every rollout address; other actor ranks none
    every worker  init_process_group()   actor rank 0: a WeightSender for those addresses (kept while
                                         they stay the same, rebuilt when the group changes)
    actor         send_weights(weights, global_steps)
                                         rank 0 pushes `weights` as version `global_steps`; the other
                                         ranks walk `weights` (producing each tensor may be collective)
    rollout       receive_weights(global_steps)
                                         yields (name, tensor) as buckets land (a StreamSink)
    every worker  finalize()             nothing: connections and shared-memory rings are reused

verl builds the actor's engines with `is_master=` and the rollout's without it; that is how an
engine knows its side. Options come from `engine_kwargs.weightsync` (`EngineKwargs`), checked once
when the engine is built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import numbers
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Literal

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from weightsync.checksum import Verify
from weightsync.dtypes import dtype_name
from weightsync.errors import ConfigError, PlanError, TransferTimeout
from weightsync.options import DEFAULT_TIMEOUT_S, ReceiverOptions, SenderOptions
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender
from weightsync.sizing import align_down, parse_bucket_bytes
from weightsync.source import TensorMeta
from weightsync.stream import StreamSink
from weightsync.transports import get_transport, serving_transports

__all__ = ["BACKEND", "EngineKwargs", "Endpoint", "WeightSyncCheckpointEngine"]

log = logging.getLogger(__name__)

BACKEND = "weightsync"
"""The name verl's config gives: `checkpoint_engine.backend=weightsync`."""

Named = tuple[str, torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineKwargs:
    """What `checkpoint_engine.engine_kwargs.weightsync` may set; every key is optional."""

    transport: str = "shm"
    """"shm" or "cudaipc" (trainer and rollout on one host), "tcp" or "collective" (any hosts)."""
    bucket_bytes: int | str = "auto"
    """The sender's bucket: "auto" (sized from the tensors) or bytes; never above verl's
    `update_weights_bucket_megabytes`, which is the sender's maximum bucket."""
    verify: Verify = "off"
    """"off", "bucket" or "full" (checksums checked before a tensor reaches the rollout)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any single wait may last, on either side; a failure surfaces as an exception."""
    cast: str | None = None
    """Send floating-point tensors as this dtype (e.g. "bfloat16" for fp32 master weights),
    converted while packed, with no full-size temporary."""
    host: str = "127.0.0.1"
    """tcp, collective: the interface rollout workers listen on, or "auto" for the node's address
    as Ray knows it (beyond loopback, every worker needs $WEIGHTSYNC_AUTH_TOKEN)."""
    port: int = 0
    """tcp, collective: the port rollout workers listen on (0: any free one)."""
    num_slots: int = 2
    """Ring slots (shm, cudaipc): 2 lets packing overlap landing."""
    max_bucket_bytes: int | str = "auto"
    """The largest bucket a rollout worker accepts ("auto": half its memory budget)."""

    @classmethod
    def parse(cls, kwargs: dict[str, Any]) -> EngineKwargs:
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ConfigError(f"unknown engine_kwargs.{BACKEND} key(s) {unknown}; expected some of {known}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        spec = get_transport(self.transport)
        if not spec.across_processes:
            usable = ", ".join(serving_transports())
            raise ConfigError(f"transport {self.transport!r} cannot reach another process; use one of {usable}")
        if self.cast is not None and not _dtype(self.cast).is_floating_point:
            raise ConfigError(f"cast must name a floating-point dtype, got {self.cast!r}")

    def sender_options(self, bucket_size: int) -> SenderOptions:
        """The actor's options: `bucket_size` (verl's, bytes) bounds the bucket and the ring."""
        ceiling = parse_bucket_bytes(bucket_size, "update_weights_bucket_megabytes")
        if ceiling is None:
            raise ConfigError("verl's bucket_size must be a number of bytes (update_weights_bucket_megabytes << 20)")
        wanted = parse_bucket_bytes(self.bucket_bytes)
        if wanted is not None and wanted > ceiling:
            raise ConfigError(
                f"bucket_bytes={wanted} is above verl's update_weights_bucket_megabytes ({ceiling} bytes)"
            )
        return SenderOptions(
            bucket_bytes=self.bucket_bytes,
            # "auto" picks at most the budget split over the slots: at most verl's bucket size
            memory_budget_bytes=align_down(ceiling) * self.num_slots,
            cast=None if self.cast is None else _dtype(self.cast),
            timeout=self.timeout,
            num_slots=self.num_slots,
            verify=self.verify,
        )

    def receiver_options(self) -> ReceiverOptions:
        """A rollout worker's options."""
        return ReceiverOptions(
            host=_node_address() if self.host == "auto" else self.host,
            port=self.port,
            max_bucket_bytes=self.max_bucket_bytes,
            timeout=self.timeout,
            verify=self.verify,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """What a worker's `prepare()` returns for `build_topology`."""

    role: Literal["actor", "rollout"]
    address: str = ""
    """A rollout worker's receiver address ("" for an actor worker)."""
    is_master: bool = False
    """The actor worker that sends (verl's rank 0)."""


@CheckpointEngineRegistry.register(BACKEND)
class WeightSyncCheckpointEngine(CheckpointEngine):
    """A verl `CheckpointEngine` over weightsync (see the module docstring for the sequence).

    Args:
        bucket_size: verl's `update_weights_bucket_megabytes`, in bytes: the sender's largest bucket.
        is_master: given by verl on the actor side only (rank 0 sends); absent on rollout workers.
        **engine_kwargs: `engine_kwargs.weightsync` (`EngineKwargs`).

    Raises:
        ConfigError: an unknown or invalid key (when verl builds the engine, before any sync).
    """

    def __init__(self, bucket_size: int, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        self.settings = EngineKwargs.parse(engine_kwargs)
        self.role: Literal["actor", "rollout"] = "rollout" if is_master is None else "actor"
        self.is_master = bool(is_master)
        self.sender_options = self.settings.sender_options(bucket_size) if self.role == "actor" else None
        """The actor's options for its `WeightSender`, from verl's bucket size (None on a rollout worker)."""
        self.receiver_options = self.settings.receiver_options() if self.role == "rollout" else None
        """A rollout worker's options for its `WeightReceiver` (None on an actor worker)."""
        self._rank: int | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._sink: StreamSink | None = None
        self._metas: list[TensorMeta] | None = None
        """The tensors verl's generator yields, learned on the first sync (a plan needs them first)."""
        self._last_version = -1

    # --- the group ----------------------------------------------------------------------------

    def prepare(self) -> Endpoint:
        """Rollout: listen (once; the same address every sync). Actor: say whether it sends."""
        if self.role == "actor":
            return Endpoint("actor", is_master=self.is_master)
        if self._receiver is None:
            self._sink = StreamSink(timeout=self.settings.timeout)
            self._receiver = WeightReceiver(self._sink, self.settings.transport, options=self.receiver_options).start()
        return Endpoint("rollout", self._receiver.address)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 sends to every rollout worker; the other actor ranks send nothing.

        Args:
            actor_wg_world_size: actor workers; their `prepare()` results come first in `metadata`.
            rollout_world_size: rollout workers; their results follow.
            metadata: every worker's `Endpoint`.

        Returns:
            The keyword arguments of `init_process_group` for each actor and each rollout worker.
        """
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size or not all(isinstance(m, Endpoint) for m in metadata):
            raise ConfigError(
                f"expected {actor_wg_world_size} + {rollout_world_size} weightsync endpoints, got {metadata!r}"[:500]
            )
        if [m.role for m in metadata] != ["actor"] * len(actors) + ["rollout"] * len(rollouts):
            raise ConfigError("endpoints out of order: actor workers first, then rollout workers")
        if not actors or not actors[0].is_master:
            raise ConfigError("actor rank 0 must be the sender (verl builds it with is_master=True)")
        addresses = tuple(m.address for m in rollouts)
        world_size = 1 + rollout_world_size
        actor_kwargs: dict[str, list[Any]] = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "addresses": [addresses] + [()] * (actor_wg_world_size - 1),
        }
        rollout_kwargs: dict[str, list[Any]] = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "addresses": [()] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, addresses: tuple[str, ...] = ()) -> None:
        """Actor rank 0: a sender for `addresses`, rebuilt only when they changed."""
        self._rank = rank
        if self.role == "rollout":
            if self._receiver is None:
                raise ConfigError("init_process_group before prepare on a rollout worker")
            return
        if self._sender is not None and tuple(self._sender.addresses) == tuple(addresses):
            return
        self._close_sender()
        if rank != 0 or not addresses:
            return
        self._sender = WeightSender(list(addresses), options=self.sender_options)
        log.info("weightsync: sending to %d rollout workers over %s", len(addresses), self.settings.transport)

    def finalize(self) -> None:
        """Nothing to free between syncs: connections and rings are kept for the next one."""

    def close(self) -> None:
        """Release the sender or receiver (not part of verl's API: for a worker's shutdown)."""
        self._close_sender()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = self._sink = None

    def _close_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    # --- a sync -------------------------------------------------------------------------------

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Push `weights`, verl's generator of (name, tensor), as version `global_steps`.

        Rank 0 pushes; the other actor ranks walk `weights` and return. Tensors are produced one
        at a time, on this event loop's thread, as the push needs them (DTensors gathered with
        `full_tensor()` just then). A plan needs every tensor's name, shape and dtype before the
        first byte moves, and a generator says them only by running: the first sync walks
        `weights` once before it sends (DTensors kept as shards, other device tensors copied to
        the host), and later syncs reuse what it learned, streaming.

        Returns:
            Metrics for verl's trainer: seconds, GB/s, bytes and buckets of the push.

        Raises:
            SyncFailed: some rollout worker did not commit (the others did).
            PlanError: the tensors differ from the last sync's (nothing committed; the next sync
                learns the new ones).
            ConfigError: called before `init_process_group`, or on a rollout worker.
        """
        if self.role != "actor" or self._rank is None:
            raise ConfigError("send_weights needs an actor worker after init_process_group")
        version = self._version(global_steps)
        if self._rank != 0 or self._sender is None:
            await _drain(weights)
            return {}
        loop = asyncio.get_running_loop()
        produced: Any = weights
        if self._metas is None:
            produced = await _stage(weights)
            self._metas = [TensorMeta(name, tuple(tensor.shape), tensor.dtype) for name, tensor in produced]
        source = _Source(self._metas, _LoopIterator(produced, loop, self.settings.timeout))
        sender = self._sender
        try:
            report = await asyncio.to_thread(sender.push, source, version)
        except asyncio.CancelledError:
            raise  # the push thread may still be stepping `weights`: leave it alone
        except BaseException as exc:
            if isinstance(exc, PlanError):
                self._metas = None
            await _drain(weights)  # the other ranks' gathers go on: keep in step with them
            raise
        return {
            f"{BACKEND}/seconds": report.seconds,
            f"{BACKEND}/gbps": report.gbps,
            f"{BACKEND}/bytes": float(report.total_bytes),
            f"{BACKEND}/buckets": float(report.num_buckets),
        }

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Named]:
        """The next sync's (name, tensor) pairs, as its buckets land, for verl's server adapter.

        Each tensor is valid until the adapter asks for the next one (copy what you keep). The
        iteration ends once the sync committed (every tensor taken, the sync verified), or raises
        its error; an adapter that stops early aborts the sync.
        """
        if self._sink is None or self._receiver is None:
            raise ConfigError("receive_weights needs a rollout worker after prepare")
        stream = self._sink.stream(version=None if global_steps is None else _as_version(global_steps))
        try:
            while True:
                item = await asyncio.to_thread(next, stream, None)
                if item is None:
                    break
                yield item
        finally:
            stream.close()
        version = stream.committed_version
        if version is not None:  # the receiver's status follows the sink's commit at once
            await asyncio.to_thread(self._receiver.wait_for_version, version, self.settings.timeout)

    @property
    def version(self) -> int | None:
        """Rollout: the last version committed intact, or None."""
        return None if self._receiver is None else self._receiver.version

    def _version(self, global_steps: int | None) -> int:
        version = self._last_version + 1 if global_steps is None else _as_version(global_steps)
        self._last_version = version
        return version


class _Source:
    """verl's one-pass generator as a `WeightSource`, with the metadata learned on the first sync."""

    def __init__(self, metas: list[TensorMeta], pull: Iterator[Named]) -> None:
        self._metas = metas
        self._pull = pull

    def metas(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[Named]:
        for index, meta in enumerate(self._metas):
            item = next(self._pull, None)
            if item is None:
                raise PlanError(f"verl's weights ended before {meta.name!r}, which the last sync had")
            if index == len(self._metas) - 1:
                extra = next(self._pull, None)  # before the last bucket goes: nothing commits
                if extra is not None:
                    raise PlanError(f"verl's weights yield {extra[0]!r}, which the last sync did not have")
            yield item


class _LoopIterator:
    """Steps verl's weights (a generator or an async iterator) on the event loop's thread, for a
    push running on another thread: the trainer's gathers stay on the thread verl runs them on."""

    def __init__(self, weights: Any, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._items = _items(weights)
        self._loop = loop
        self._timeout = timeout

    def __iter__(self) -> _LoopIterator:
        return self

    def __next__(self) -> Named:
        future = asyncio.run_coroutine_threadsafe(self._step(), self._loop)
        try:
            item = future.result(self._timeout)
        except TimeoutError:
            future.cancel()
            raise TransferTimeout(f"verl's weights yielded nothing for {self._timeout:g} s") from None
        if item is None:
            raise StopIteration
        return item

    async def _step(self) -> Named | None:
        try:
            name, tensor = await anext(self._items)
        except StopAsyncIteration:
            return None
        return name, _full(tensor)


async def _items(weights: Any) -> AsyncIterator[Named]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def _drain(weights: Any) -> None:
    """Walk what is left of `weights`, gathering DTensors as rank 0 does, keeping nothing."""
    async for _name, tensor in _items(weights):
        _full(tensor)


async def _stage(weights: Iterable[Named] | AsyncIterator[Named]) -> list[Named]:
    """Every (name, tensor) of a first sync: DTensors kept as they are (gathered when sent), other
    device tensors copied to the host, so the trainer's device holds no second model."""
    staged = []
    async for name, tensor in _items(weights):
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"verl's weights must yield (name, tensor) pairs, got {type(tensor).__name__}")
        keep = tensor if hasattr(tensor, "full_tensor") or tensor.device.type == "cpu" else tensor.detach().to("cpu")
        staged.append((name, keep))
    return staged


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank: gathered if it is a DTensor shard (a collective)."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor().detach()
    return tensor.detach()


def _as_version(global_steps: object) -> int:
    if isinstance(global_steps, bool) or not isinstance(global_steps, numbers.Integral) or int(global_steps) < 0:
        raise ConfigError(f"global_steps must be a non-negative integer or None, got {global_steps!r}")
    return int(global_steps)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"cast names no torch dtype: {name!r}")
    dtype_name(dtype)  # ConfigError for a dtype weightsync cannot send
    return dtype


def _node_address() -> str:
    import ray  # verl's workers are Ray actors

    return str(ray.util.get_node_ip_address()).strip("[]")
