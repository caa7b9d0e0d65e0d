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

Each `send_weights` is one round of `weightsync.round.run_round` (its phases at its call site
there) through `VLLMWindow`: vLLM's `start_weight_update`, `update_weights({"version": v})`
beside the push, and `finish_weight_update` labelling `v` only when every worker landed it. A
failed round follows the one rule of docs/failure-semantics.md: where no worker's weights
changed (a worker refused the sender or the plan) vLLM keeps serving its last version, labelled
as before; otherwise it reports the weight version `NOT_READY` and, through an HTTP client,
generation pauses until a round labels a version.

Sharded (`WeightsyncTrainerInitInfo(rank=r, sharded=True)`, an FSDP2 trainer): every rank calls
`trainer_init` and `send_weights` with its `ModuleSource`, and every rank pushes the rows it
holds, straight to the workers that keep them (no rank gathers a tensor). Rank 0 still drives
vLLM; the ranks agree at each step over a gloo group of their own (weightsync/ranks.py, the round's
`Agreement`), so that they all return, or all raise, and a version is labelled only when every
rank's part committed on every worker. A solo trainer is the same round with an agreement of one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.request
from collections.abc import Iterator
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

from weightsync.errors import ConfigError, ConnectError, one_line
from weightsync.integrations.vllm.internals import module_of
from weightsync.integrations.vllm.plugin import register
from weightsync.integrations.vllm.worker import as_init_info
from weightsync.module_source import ModuleSource
from weightsync.options import ReceiverOptions, SenderOptions
from weightsync.ranks import Ranks
from weightsync.report import SyncReport
from weightsync.round import NOT_READY, SOLO, Outcome, WorkerState, run_round, states_of
from weightsync.sender import WeightSender
from weightsync.source import ShardedSource, TensorMeta, WeightSource
from weightsync.workers.rendezvous import Rendezvous, WorkerAddress
from weightsync.workers.start import Start

__all__ = ["VLLMSource", "VLLMWindow", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"]

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
            workers' addresses (workers/rendezvous.py); loopback by default, the trainer's reachable
            address when the workers run on other hosts.
        receiver_host: where each worker's receiver listens (networked transports).
        options: the sender's options: bucket size, cast, verification, delta, timeout, token,
            `allow_older_version` (`raise_on_failure` is not among them: `send_weights` always raises `SyncFailed`,
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
        self.window = VLLMWindow(client, len(self.workers))
        """vLLM's update window, as every round drives it (rank 0's)."""

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
                staged=bool(options.delta),  # a patch lands in a standby copy (docs/delta.md)
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
            ConfigError: `version` is not larger than the last one (unless the options say
                `allow_older_version`: every worker's receiver refuses it too).
            Whatever the source's index (`metadata()`) raised: no window was opened.
            SyncFailed: some worker did not land the version, or refused this sender (then no
                update window was opened); none was labelled, no worker is left inside an
                update, and the message says whether the previous version serves or vLLM is
                not ready (module docstring).
            CollectiveError: sharded, another trainer rank died or did not get to this push
                within the timeout (+ 30 s); rank 0 decided the window all the same.
        """
        source = _as_weightsync(self.source, sharded=self.ranks is not None)
        if self.sender is None:
            for _ in source.tensors():  # materialising a tensor may be a collective: stay in step
                pass
            return None
        version = self.version + 1 if version is None else version
        floor = -1 if self.sender.options.allow_older_version else self.version
        if isinstance(version, bool) or not isinstance(version, int) or version <= floor:
            raise ConfigError(
                f"version must be an integer above the last one ({self.version}), got {version!r} "
                "(allow_older_version=True in the options moves vLLM back)"
            )
        agreement = self.ranks if self.ranks is not None else SOLO
        wait_s = self.sender.options.timeout + RPC_MARGIN_S
        report = run_round(
            self.sender, source, version, self.window, agreement, wait_s=wait_s, walk_unpushed=agreement is SOLO
        )
        self.version = version
        return report

    def shutdown(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


class VLLMWindow:
    """vLLM's update window through its trainer client, for `weightsync.round.run_round`.

    vLLM's workers land a push as it arrives (worker.py), so a worker that did not commit may
    hold a mix: the round is then not ready. vLLM then reports the weight version `NOT_READY`
    (`finish_weight_update`'s label, through any client), and, through an HTTP client, its
    generation is paused (vLLM's `/pause`, abort) until a round labels a version, which resumes
    it. A window that finds generation paused already (by its caller) leaves that pause to its
    caller: vLLM has one switch.
    """

    def __init__(self, client: VLLMWeightSyncClient, num_workers: int) -> None:
        self.client = client
        self.num_workers = num_workers
        self.ready = True
        """vLLM serves an intact version (False: a round left its weights no version)."""
        self._paused = False
        """This window paused vLLM's generation (not ready): the next label resumes it."""

    def start(self, version: int) -> None:
        self.client.start_weight_update()

    def update(self, version: int) -> None:
        self.client.update_weights({"version": version})

    def states(self, report: SyncReport | None) -> tuple[list[WorkerState], list[str]]:
        return states_of(report, self.num_workers), []

    def finish(self, version: int, outcome: Outcome) -> None:
        if outcome.verdict == "label":
            self.client.finish_weight_update(str(version))
            self.ready = True
            if self._paused:
                self._paused = not self._route("resume")
            return
        try:  # a worker that failed ended its own reload already
            self.client.finish_weight_update(None if outcome.ready else NOT_READY)
        except Exception as exc:
            log.info("ending the failed update: %s", one_line(exc))
        if not outcome.ready:
            self.ready = False
            self._paused = self._paused or (not self._route("is_paused") and self._route("pause?mode=abort"))

    def _route(self, path: str) -> bool:
        """vLLM's own `/pause`, `/resume` or `/is_paused` (whether it is paused), through an HTTP
        client's server; False for any other client, or when the call failed."""
        base = getattr(self.client, "base_url", None)
        if not isinstance(base, str):
            return False
        method = "GET" if path == "is_paused" else "POST"
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{base}/{path}", method=method), timeout=30) as reply:
                body = json.loads(reply.read() or b"{}")
        except (OSError, ValueError) as exc:
            log.warning("vLLM's /%s failed: %s", path, exc)
            return False
        return bool(body.get("is_paused", True))


def _sender(workers: list[WorkerAddress], options: SenderOptions) -> WeightSender:
    """A sender to every worker; its push returns its report whatever happened (a failed round
    must end vLLM's update on every worker before `send_weights` raises)."""
    return WeightSender(
        [worker.address for worker in workers], options=dataclasses.replace(options, raise_on_failure=False)
    )


register()  # a trainer process loads no vLLM plugins: taking these classes registers the backend
