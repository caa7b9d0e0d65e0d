"""The trainer half of vLLM's `weightsync` backend: a `WeightSender` behind vLLM's trainer API.

Code written against vLLM's own trainer API switches to weightsync by naming it::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=0, transport="shm"),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model),
    )
    engine.send_weights()          # after every optimizer step

One round of `send_weights`, every phase at its call site::

    sender.connect()                             every worker's receiver takes this sender
    client.start_weight_update()                 every worker: vLLM's layerwise reload begins
    client.update_weights({"version": v})  ||    every worker lands version v as it arrives
    sender.push(source, v)                       one push to every worker's receiver
    client.finish_weight_update(str(v))          every worker: reload ends; vLLM labels v

The update call and the push run side by side (a worker's `update_weights` returns once its
receiver has landed the sync, or at once when its receiver refused the push), and a version is
labelled only when the push committed on every worker and every worker's update returned.
Otherwise `send_weights` raises `SyncFailed` and no version is labelled. A worker that refuses
the sender itself (another auth token, unreachable) fails the round before any window opens.

Sharded (`WeightsyncTrainerInitInfo(rank=r, sharded=True)`, an FSDP2 trainer): every rank calls
`trainer_init` and `send_weights` with its `ModuleSource`, and every rank pushes the rows it
holds, straight to the workers that keep them (no rank gathers a tensor). Rank 0 still drives
vLLM; the ranks agree at each step over a gloo group of their own (ranks.py), so that they all
return, or all raise, and a version is labelled only when every rank's part committed on every
worker::

    rank 0: rendezvous; every rank: the workers' addresses, a sender to each
    every rank: sender.connect()   (all connected, or every rank raises)
    rank 0: client.start_weight_update(), then client.update_weights({"version": v}) ||
    every rank: sender.push(its part of the source, v)
    rank 0: client.finish_weight_update(str(v)) once every rank's push committed and vLLM's
            update returned; else it ends the update, and every rank raises SyncFailed
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Self

import msgspec
import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
)
from vllm.distributed.weight_transfer.base import WeightSource as VLLMWeightSource

from weightsync.errors import (
    CollectiveError,
    ConfigError,
    ConnectError,
    RemoteError,
    SyncFailed,
    WeightSyncError,
    one_line,
)
from weightsync.integrations.vllm.internals import module_of
from weightsync.integrations.vllm.plugin import register
from weightsync.integrations.vllm.ranks import Ranks
from weightsync.integrations.vllm.worker import as_init_info
from weightsync.module_source import ModuleSource
from weightsync.options import ReceiverOptions, SenderOptions
from weightsync.report import ReceiverOutcome, SyncReport
from weightsync.sender import WeightSender
from weightsync.source import ShardedSource, TensorMeta, WeightSource
from weightsync.workers.rendezvous import Rendezvous, WorkerAddress
from weightsync.workers.start import Start

__all__ = ["VLLMSource", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"]

log = logging.getLogger(__name__)

RPC_MARGIN_S = 30.0
"""Seconds the workers' update call may outlast the sender's own timeout (the HTTP round trip,
vLLM's own RPC): every wait on the worker's side is bounded by that timeout too."""


@dataclasses.dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """What the trainer's engine is built from (`rank` is vLLM's: 0 sends, the others only walk
    the source, which may be a collective).

    Attributes:
        transport: how the bytes travel: "shm" (same host; one ring read by every worker),
            "tcp", "collective" or "nixl" (any host).
        rendezvous_host: where the trainer's rendezvous store listens while it learns the
            workers' addresses (rendezvous.py); loopback by default, the trainer's reachable
            address when the workers run on other hosts.
        receiver_host: where each worker's receiver listens (networked transports).
        options: the sender's options: bucket size, cast, verification, delta, timeout, token
            (`raise_on_failure` is not among them: `send_weights` always raises `SyncFailed`,
            once it has ended vLLM's update).
        sharded: every trainer rank pushes the rows it holds (an FSDP2 trainer; module
            docstring): every rank calls `trainer_init` and `send_weights`, with
            torch.distributed initialised. False: rank 0 pushes whole tensors.
    """

    backend: ClassVar[str] = "weightsync"

    transport: str = "shm"
    rendezvous_host: str = "127.0.0.1"
    receiver_host: str = "127.0.0.1"
    options: SenderOptions = dataclasses.field(default_factory=SenderOptions)
    sharded: bool = False


class _Source:
    """vLLM's `WeightSource` (`metadata()`, iteration) as weightsync's (`metas()`, `tensors()`)."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(meta.name, tuple(meta.shape), meta.dtype) for meta in self._source.metadata()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._source)


class VLLMSource(VLLMWeightSource):
    """A weightsync `WeightSource` as vLLM's `WeightSource`, for code written against vLLM's
    trainer API; e.g. a transformers 5 model in its checkpoint's names (one tensor per expert)::

        source = VLLMSource(HFCheckpointSource(model))   # weightsync.hf_checkpoint
        WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)

    The weightsync backend takes the wrapped source back as it is (no conversion).
    """

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(meta.name, meta.dtype, meta.shape) for meta in self.source.metas()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.source.tensors()


def _as_weightsync(source: Any, *, sharded: bool = False) -> WeightSource:
    """A weightsync `WeightSource` as it is (unwrapped from `VLLMSource`); vLLM's `ModuleSource`
    as weightsync's over the same module (which cuts what each worker keeps, and shards); any
    other of vLLM's wrapped.

    Raises:
        ConfigError: `sharded`, and the source cannot push in parts.
    """
    if isinstance(source, VLLMSource):
        found: WeightSource = source.source
    elif isinstance(source, WeightSource):
        found = source
    else:
        module = module_of(source)
        found = ModuleSource(module, sharded=sharded) if module is not None else _Source(source)
    if sharded and not (isinstance(found, ShardedSource) and getattr(found, "sharded", True)):
        raise ConfigError(
            f"a sharded push needs a source that pushes in parts (weightsync's ModuleSource or "
            f"HFCheckpointSource with sharded=True, or vLLM's ModuleSource), not {type(found).__name__}"
        )
    return found


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """vLLM's trainer-side weight transfer engine for `backend="weightsync"` (module docstring).

    Built by `WeightTransferTrainerFactory.trainer_init` (or this class's `trainer_init`).
    """

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: Any,
        is_sender: bool = True,
        sender: WeightSender | None = None,
        workers: list[WorkerAddress] | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.workers = workers or []
        """The workers' receivers, as they announced themselves (empty on non-sender ranks)."""
        self.version = 0
        """The last version labelled in vLLM (0: none yet)."""
        self.ranks: Ranks | None = None
        """Sharded: the trainer's ranks, which every push is agreed with."""

    @classmethod
    def trainer_init(
        cls, init_info: WeightsyncTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Any = None
    ) -> Self:
        """Start every worker's receiver and connect a sender to all of them (rank 0 only).

        Raises:
            ConfigError: no source was given.
            ConnectError: no worker announced itself.
            ResourceError: the rendezvous store could not listen.
        """
        if source is None:
            raise ConfigError("the weightsync backend sends a WeightSource: pass source=")
        if init_info.sharded:
            return cls._init_sharded(init_info, client, source)
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        workers = cls._rendezvous(init_info, client)
        sender = _sender(workers, init_info.options)
        log.info("weightsync: %d vLLM worker(s) over %s", len(workers), init_info.transport)
        return cls(client=client, source=source, sender=sender, workers=workers)

    @classmethod
    def _init_sharded(cls, init_info: WeightsyncTrainerInitInfo, client: VLLMWeightSyncClient, source: Any) -> Self:
        """Every rank: rank 0 finds the workers and shares their addresses; every rank gets a
        sender to all of them."""
        ranks = Ranks(init_info.options.timeout + RPC_MARGIN_S)
        found: list[WorkerAddress] = []
        try:
            if init_info.is_sender:
                found = cls._rendezvous(init_info, client)
        finally:  # the other ranks wait for these bytes: they get them, or none, whatever happened
            shared = ranks.share(msgspec.json.encode(found) if found else b"")
        if not shared:
            raise ConnectError("no vLLM worker announced its receiver (rank 0 could not reach them)")
        workers = msgspec.json.decode(shared, type=list[WorkerAddress])
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            sender=_sender(workers, init_info.options),
            workers=workers,
        )
        engine.ranks = ranks
        log.info(
            "weightsync: rank %d of %d pushes its part to %d vLLM worker(s)", ranks.rank, ranks.world, len(workers)
        )
        return engine

    @staticmethod
    def _rendezvous(init_info: WeightsyncTrainerInitInfo, client: VLLMWeightSyncClient) -> list[WorkerAddress]:
        """Start every worker's receiver; their addresses.

        Raises:
            ConnectError: no worker announced itself.
        """
        options = init_info.options
        with Rendezvous(init_info.rendezvous_host, options.timeout) as rendezvous:
            worker_info = Start(
                rendezvous=rendezvous.where,
                session=rendezvous.session,
                transport=init_info.transport,
                receiver=ReceiverOptions(
                    host=init_info.receiver_host, timeout=options.timeout, verify=options.verify
                ).without_token(),
            )
            client.init_weight_transfer_engine(as_init_info(worker_info))
            workers = rendezvous.collect()
        if not workers:
            raise ConnectError("no vLLM worker announced its receiver; is the server's backend 'weightsync'?")
        return workers

    def send_weights(self, version: int | None = None) -> SyncReport | None:
        """Push the source to every worker and label it in vLLM as `version` (default: the last
        version + 1). Returns the push's report (None on ranks other than 0, which only walk the
        source).

        Raises:
            ConfigError: `version` is not larger than the last one.
            Whatever the push raised before its offer (a bad cast, a source that fails): every
                worker heard it at once and left the update; nothing was labelled.
            SyncFailed: some worker did not land the version, or refused this sender (then no
                update window was opened); none was labelled, and no worker is left inside an
                update.
            CollectiveError: sharded, another trainer rank died or did not get to this push
                within the timeout (+ 30 s); nothing was labelled, and no worker is left inside
                an update.
        """
        source = _as_weightsync(self.source, sharded=self.ranks is not None)
        if self.sender is None:
            for _ in source.tensors():  # materialising a tensor may be a collective: stay in step
                pass
            return None
        version = self.version + 1 if version is None else version
        if isinstance(version, bool) or not isinstance(version, int) or version <= self.version:
            raise ConfigError(f"version must be an integer above the last one ({self.version}), got {version!r}")
        if self.ranks is not None:
            return self._send_sharded(source, version, self.ranks, self.sender)

        # A worker that refuses this sender (its token, its protocol) or cannot be reached would
        # never see the push: its update call would wait out its timeout. Find out first, and
        # open no window then.
        refused = self.sender.connect()
        if refused:
            for _ in source.tensors():  # as the push would: the other ranks walk it (collectives)
                pass
            report = _not_pushed(version, self.sender.addresses, refused)
            causes = [outcome.cause() for outcome in report.failed if outcome.address in refused]
            raise SyncFailed(f"version {version} was not labelled: " + "; ".join(causes), report)

        self.client.start_weight_update()
        pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-vllm-update")
        try:
            landing = pool.submit(self.client.update_weights, {"version": version})
            try:
                report = self.sender.push(source, version)
            except BaseException:  # the workers heard that the sender gave up: end the update
                _error_of(landing, self.sender.options.timeout + RPC_MARGIN_S)
                self._end_failed_update()
                raise
            landed = _error_of(landing, self.sender.options.timeout + RPC_MARGIN_S)
        finally:
            pool.shutdown(wait=False)  # never join a control-plane thread on the error path
        if report.ok and landed is None:
            self.client.finish_weight_update(str(version))
            self.version = version
            return report

        self._end_failed_update()
        why = [outcome.cause() for outcome in report.failed]
        if landed is not None:
            why.append(f"vLLM's update_weights: {one_line(landed)}")
        raise SyncFailed(f"version {version} was not labelled: " + "; ".join(why), report)

    def _send_sharded(self, source: WeightSource, version: int, ranks: Ranks, sender: WeightSender) -> SyncReport:
        """One round of a sharded push (module docstring), on every rank."""
        refused = sender.connect()
        if not ranks.settle(not refused):  # every rank, or none, goes on
            unpushed = _not_pushed(version, sender.addresses, refused)
            causes = [outcome.cause() for outcome in unpushed.failed if outcome.address in refused]
            because = "; ".join(causes) or "another rank's sender was refused"
            raise SyncFailed(f"version {version} was not labelled: {because}", unpushed)
        pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-vllm-update")
        landing = None
        try:
            landing, opening = self._open_update(pool, version)
            if not ranks.settle(opening is None):  # the window is open: every rank may push
                unopened = _not_pushed(version, sender.addresses, {})
                raise SyncFailed(f"version {version} was not labelled: vLLM's update did not open: {opening}", unopened)
            report, raised = _pushed(sender, source, version)
            landed = _error_of(landing, sender.options.timeout + RPC_MARGIN_S) if landing is not None else None
            ok = ranks.settle(raised is None and report is not None and report.ok and landed is None)
        except CollectiveError:  # a rank died or fell behind: no label, and vLLM is not left inside the update
            if landing is not None:
                _error_of(landing, sender.options.timeout + RPC_MARGIN_S)
                self._end_failed_update()
            raise
        finally:
            pool.shutdown(wait=False)  # never join a control-plane thread on the error path
        if self.is_sender and ok:
            self.client.finish_weight_update(str(version))
        elif self.is_sender:
            self._end_failed_update()
        if ok and report is not None:
            self.version = version
        ranks.wait()  # labelled (or not) before any rank returns
        if raised is not None:
            raise raised
        if ok and report is not None:
            return report
        why = [outcome.cause() for outcome in report.failed] if report is not None else []
        why += [f"vLLM's update_weights: {one_line(landed)}"] if landed is not None else []
        raise SyncFailed(
            f"version {version} was not labelled: " + ("; ".join(why) or "another rank's part failed"), report
        )

    def _open_update(self, pool: ThreadPoolExecutor, version: int) -> tuple[Any, str | None]:
        """Rank 0: vLLM's update window opened, and its update call for `version` started on
        `pool`; why it did not open (None: it did). The other ranks: nothing to open."""
        if not self.is_sender:
            return None, None
        try:
            self.client.start_weight_update()
        except Exception as exc:
            return None, one_line(exc)
        return pool.submit(self.client.update_weights, {"version": version}), None

    def _end_failed_update(self) -> None:
        """End the update on every worker still inside it, so that the next round can start;
        the weights are then no version vLLM can name (it keeps the last label)."""
        try:
            self.client.finish_weight_update()
        except Exception as exc:  # a worker that failed already ended its own update
            log.info("ending the failed update: %s", exc)

    def shutdown(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


def _not_pushed(version: int, addresses: list[str], refused: dict[str, WeightSyncError]) -> SyncReport:
    """The report of a push that never started: the workers in `refused` would not take this
    sender (why), so no worker was sent anything."""
    outcomes = []
    for address in addresses:
        error = refused.get(address)
        if error is None:
            outcomes.append(
                ReceiverOutcome(address, False, "SyncFailed", "not pushed: another worker refused the sender")
            )
        else:
            kind = error.kind if isinstance(error, RemoteError) and error.kind else type(error).__name__
            outcomes.append(ReceiverOutcome(address, False, kind, str(error)))
    return SyncReport(version, 0, 0, 0, 0, 0.0, tuple(outcomes))


def _sender(workers: list[WorkerAddress], options: SenderOptions) -> WeightSender:
    """A sender to every worker; its push returns its report whatever happened (a failed round
    must end vLLM's update on every worker before `send_weights` raises)."""
    return WeightSender(
        [worker.address for worker in workers], options=dataclasses.replace(options, raise_on_failure=False)
    )


def _pushed(sender: WeightSender, source: WeightSource, version: int) -> tuple[SyncReport | None, BaseException | None]:
    """`sender.push(source, version)`: its report, or what it raised (the other ranks must hear
    of it before this one raises)."""
    try:
        return sender.push(source, version), None
    except Exception as exc:
        return None, exc


def _error_of(future: Any, timeout: float) -> BaseException | None:
    """The error `future` ended with, None if it succeeded, or a timeout error after `timeout`."""
    try:
        future.result(timeout=timeout)
    except TimeoutError:
        return TimeoutError(f"no answer within {timeout:g} s")
    except Exception as exc:
        return exc
    return None


register()  # a trainer process loads no vLLM plugins: taking these classes registers the backend
