"""The worker half of vLLM's `weightsync` backend: a `WeightReceiver` in every vLLM worker.

vLLM builds one `WeightsyncWorkerEngine` per worker (every tensor-, pipeline- and data-parallel
rank) from `--weight-transfer-config '{"backend": "weightsync"}'`, and drives it with its own
weight-update lifecycle::

    init_transfer_engine(info)   start this worker's receiver; tell the trainer its address
                                 (rendezvous.announce)
    start_weight_update()        vLLM's layerwise reload begins; the receiver accepts one sync
    update_weights({"version"})  land that sync: every tensor the trainer pushes goes through
                                 the model's own `load_weights` on this thread (each rank's
                                 loader slices its own shard), as the buckets arrive
    finish_weight_update()       vLLM's layerwise reload ends (post-processing, repacking)
    shutdown()                   close the receiver

A push that arrives outside a start/finish window is refused before any byte moves, and so is a
plan that does not match the model's checkpoint (a name twice, a name missing, a wrong shape or
dtype, an empty sync): vLLM's layerwise reload counts elements, not names, and would otherwise
finish a reload with a layer silently left as it was.

A sync that fails part way (the trainer died, a timeout, a loader error) still ends vLLM's
layerwise reload here, so that the model stays whole; the sender's report names the worker and
the reason, and the trainer labels no new version (`receive_weights` says why it does not raise).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.errors import PlanError, SinkError
from weightsync.integrations.vllm.layout import (
    CheckpointLayout,
    check_plan_layout,
    checkpoint_layout,
    cpu_experts_to_prepack,
    prepack_cpu_experts,
    reprocess_tied_layers,
)
from weightsync.integrations.vllm.rendezvous import WorkerAddress, announce
from weightsync.options import DEFAULT_TIMEOUT_S, ReceiverOptions
from weightsync.receiver import WeightReceiver
from weightsync.stream import StreamSink
from weightsync.types import Plan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["WeightsyncInitInfo", "WeightsyncUpdateInfo", "WeightsyncWorkerEngine"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """What the trainer sends every worker once (`init_weight_transfer_engine`), as JSON.

    No secret travels here: a worker takes the shared token from its own $WEIGHTSYNC_AUTH_TOKEN.
    """

    rendezvous: str
    """"HOST:PORT" of the trainer's rendezvous store, where each worker leaves its address."""
    session: str
    """Names this trainer's keys in the store."""
    transport: str = "shm"
    host: str = "127.0.0.1"
    """Where a networked receiver (tcp, collective, nixl) listens."""
    verify: str = "off"
    timeout: float = DEFAULT_TIMEOUT_S


@dataclasses.dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """What the trainer sends with every `update_weights`: the version it is pushing."""

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version must be a non-negative integer, got {self.version!r}")


class _WindowSink(StreamSink):
    """A `StreamSink` that takes a sync only inside vLLM's weight-update window, and only one
    whose plan matches the model's checkpoint layout.

    Its tensors are the receiver's own (`borrows = False`): vLLM's layerwise loader keeps a
    layer's tensors until the layer is complete, after the bucket's buffer was reused.
    """

    borrows = False

    def __init__(self, layout: CheckpointLayout, *, timeout: float) -> None:
        super().__init__(timeout=timeout)
        self.layout = layout
        self.open = False
        """True between vLLM's start_weight_update and the end of its update."""
        self.feed: dict[str, str | None] = {}
        """The name each planned tensor is loaded under (None: a tied duplicate, not loaded)."""

    def begin(self, plan: Plan, version: int) -> None:
        if not self.open:
            raise SinkError(
                f"version {version} refused: no weight update is open on this vLLM worker "
                "(the trainer calls start_weight_update before it pushes)"
            )
        super().begin(plan, version)
        try:
            self.feed = check_plan_layout(plan, self.layout)
        except PlanError as exc:
            # vLLM's update call waits on this sync: it ends now, on every worker alike, rather
            # than after its timeout.
            self.abort(version, exc, intact=True)
            raise


class WeightsyncWorkerEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """vLLM's worker-side weight transfer engine for `backend="weightsync"` (module docstring)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: WeightReceiver | None = None
        self._sink: _WindowSink | None = None
        self._reloading = False
        """Between vLLM's initialize and finalize of its layerwise reload."""

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        self.shutdown()  # a trainer that starts again gets a fresh receiver
        options = ReceiverOptions(
            host=init_info.host,
            timeout=init_info.timeout,
            verify=init_info.verify,  # type: ignore[arg-type]  # checked by ReceiverOptions
        )
        layout = checkpoint_layout(self.model_config.model, self.model_config.dtype)
        self._sink = _WindowSink(layout, timeout=options.timeout)
        self._receiver = WeightReceiver(self._sink, init_info.transport, options=options)
        parallel = self.parallel_config
        me = WorkerAddress(
            address=self._receiver.address,
            rank=parallel.data_parallel_index * parallel.world_size + parallel.rank,
            weight_bytes=layout.total_bytes,
        )
        try:
            announce(init_info.rendezvous, init_info.session, me, timeout=options.timeout)
        except BaseException:
            self.shutdown()
            raise
        log.info("weightsync receiver of worker %d at %s", me.rank, me.address)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        sink = self._require()
        initialize_layerwise_reload(self.model)
        self._reloading = True
        sink.open = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also synchronises an accelerator, which raises on a CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        """Land the sync of `update_info.version` through the model's `load_weights`.

        A failed sync does not raise here: vLLM answers a call to all workers at the first
        worker's error and leaves the other workers' answers queued, where they would answer the
        next calls. The sender's report says which worker failed and why, and the receiver's
        status keeps it; here the reload ends (the model stays whole) and the failure is logged.
        """
        sink = self._require()
        try:
            with sink.stream(version=update_info.version) as tensors:
                for name, tensor in tensors:
                    fed = sink.feed[name]
                    if fed is not None:
                        self.model.load_weights([(fed, tensor)])
        except Exception as exc:
            log.warning("version %d did not land on this worker: %s", update_info.version, exc)
            self._end_reload()  # layers that got nothing keep their weights: the model stays whole
        finally:
            sink.open = False

    def finish_weight_update(self) -> None:
        self._require().open = False
        self._end_reload()

    def shutdown(self) -> None:
        receiver, self._receiver, self._sink = self._receiver, None, None
        if receiver is not None:
            receiver.close()

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._reloading:  # ended already, by a sync that failed
            return
        self._reloading = False
        experts = cpu_experts_to_prepack(self.model)
        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_tied_layers(self.model)
        prepack_cpu_experts(experts)

    def _require(self) -> _WindowSink:
        if self._sink is None:
            raise SinkError("weightsync's transfer engine is not initialised: call init_weight_transfer_engine")
        return self._sink
