"""The worker half of vLLM's `weightsync` backend: a `WeightReceiver` in every vLLM worker.

vLLM builds one `WeightsyncWorkerEngine` per worker (every tensor-, pipeline- and data-parallel
rank) from `--weight-transfer-config '{"backend": "weightsync"}'`, and drives it with its own
weight-update lifecycle::

    init_transfer_engine(info)   start this worker's receiver from the kit's start message
                                 (weightsync.workers.start); tell the trainer its address
    start_weight_update()        vLLM's layerwise reload begins; the receiver accepts one sync;
                                 until the reload ends, what one layer frees the next reuses
                                 (integrations/vllm/malloc.py)
    update_weights({"version"})  land that sync: every tensor the trainer pushes goes through
                                 the model's own `load_weights` on this thread (each rank's
                                 loader slices its own shard), as the buckets arrive, straight
                                 from the transport's buffer; the box of a tensor this worker
                                 keeps (below) inside a tensor of the checkpoint's shape
    finish_weight_update()       vLLM's layerwise reload ends (post-processing, repacking)
    shutdown()                   close the receiver

Sharded sync: when it starts, each worker finds the box of every checkpoint tensor its loaders
keep (`workers.layout.kept_boxes`: a dry run of `load_weights` on tensors without storage) and its
receiver names them to every sender (`Welcome.wants`), so a tensor-parallel worker is sent only
its boxes, by every trainer rank that holds some of them.

Staged (`Start.staged`), a sync lands in a standby copy first, where a delta push's patch is
applied and checked whole; at commit vLLM's reload is fed every tensor of it (`StagedSink(whole=True)`:
a layer fed only some of its tensors would be processed with the rest unset; docs/delta.md).

A push that arrives outside a start/finish window is refused before any byte moves, and so is a
plan that does not match the model's checkpoint (a name twice, a name missing, a wrong shape or
dtype, an empty sync): vLLM's layerwise reload counts elements, not names, and would otherwise
finish a reload with a layer silently left as it was. A push refused inside the window (by
those checks, or by the receiver's own: busy with another sync, a plan it cannot take) ends the
update call waiting for it at once (`_WindowSink.refused`), rather than after its timeout.

A sync that fails part way (the trainer died, a timeout, a loader error) still ends vLLM's
layerwise reload here, so that the model stays whole; the sender's report names the worker and
the reason, and the trainer labels no new version (`receive_weights` says why it does not raise).

Who opens the window: a trainer, through vLLM's API (`WeightsyncTrainerEngine`); or, under
`weightsync serve --engine vllm`, the server itself. There the start message names the server's
doorbell (`bell`), and each worker's sink (`weightsync.workers.sink.ControlledSink`) rings it as
a push arrives: the API process pauses generation and opens the window on every worker, then
answers; it labels the version only once every worker rang its commit, and refuses every
worker's commit otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.digest import source_digest
from weightsync.errors import PlanError, SinkError
from weightsync.integrations.vllm.internals import (
    MEMORY_SCHEME,
    LoraMemory,
    ReloadBuffers,
    checkpoint_format_on_meta,
    cpu_experts_to_prepack,
    prepack_cpu_experts,
    reprocess_tied_layers,
    serve_loras_from_memory,
)
from weightsync.integrations.vllm.malloc import release_freed_memory, return_large_frees_to_os, reuse_freed_memory
from weightsync.lora import Adapter, check_lora
from weightsync.messages import Plan, TensorSpec, Want
from weightsync.receiver import WeightReceiver
from weightsync.sink import StagedSink, WeightSink
from weightsync.stream import StreamSink
from weightsync.workers.layout import (
    CheckpointLayout,
    check_boxes,
    check_plan_layout,
    checkpoint_layout,
    kept_boxes,
    padded,
)
from weightsync.workers.start import Start, start_receiver

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["WeightsyncInitInfo", "WeightsyncUpdateInfo", "WeightsyncWorkerEngine", "as_init_info"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """What every worker gets once (`init_weight_transfer_engine`): the kit's start message."""

    start: dict[str, Any]
    """A `weightsync.workers.start.Start` as JSON (no secret travels in it)."""


def as_init_info(start: Start) -> dict[str, Any]:
    """vLLM's `init_info` for backend "weightsync" that carries `start` to every worker."""
    return dataclasses.asdict(WeightsyncInitInfo(start=start.to_json()))


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

    Its tensors are views into the transport's buffer (the sink borrows): vLLM's loader copies
    each into the model, and what vLLM's layerwise reload keeps past a bucket (a layer that spans
    two) is copied out before the buffer is reused (`ReloadBuffers`).

    `deferred`: `begin` only checks the plan; the sync reaches the stream at its first bucket
    (or commit), by when the server opened the window (`ControlledSink`, `StagedSink`).
    """

    def __init__(
        self, layout: CheckpointLayout, *, timeout: float, deferred: bool = False, kept: tuple[Want, ...] = ()
    ) -> None:
        super().__init__(timeout=timeout)
        self.layout = layout
        self.kept = kept
        """The box of each tensor this worker's loaders keep (`kept_boxes`)."""
        self.deferred = deferred
        self.open = False
        """True between vLLM's start_weight_update and the end of its update."""
        self.feed: dict[str, str | None] = {}
        """The name each planned tensor is loaded under (None: a tied duplicate, not loaded)."""
        self.specs: dict[str, TensorSpec] = {}
        """Each planned tensor as it travels (a box of it, for a tensor this worker keeps a box of)."""
        self._pending: tuple[Plan, int] | None = None

    def wants(self) -> tuple[Want, ...]:
        return self.kept

    def loads(self, batch: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """What vLLM's loader is handed for `batch`: each tensor under the name it is fed, a
        box inside a tensor of the checkpoint's shape; tied duplicates, and the tensors its
        loaders read nothing of (an expert another rank holds: an empty box), left out."""
        return [
            (fed, padded(self.specs[name], tensor))
            for name, tensor in batch
            if (fed := self.feed[name]) and not (self.specs[name].region is not None and tensor.numel() == 0)
        ]

    def begin(self, plan: Plan, version: int) -> None:
        self._pending = None
        feed = check_plan_layout(plan, self.layout)
        check_boxes(plan, self.kept)
        self.specs = {spec.name: spec for spec in plan.tensors}
        if not self.deferred:
            self._require_open(version)
        self.feed = feed
        if self.deferred:
            self._pending = (plan, version)
        else:
            super().begin(plan, version)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._start()
        super().load(named_tensors)

    def commit(self, version: int) -> None:
        self._start()
        super().commit(version)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:  # it never reached the stream: there it ends before it began
            self.refused(pending[1], error)
        super().abort(version, error, intact=intact)

    def refused(self, version: int, error: BaseException) -> None:
        """The receiver refused the offer of `version` (this sink's checks, or its own: busy, a
        plan it cannot take): vLLM's update call waiting for it ends now, on every worker alike,
        rather than after its timeout. Outside the window no update call waits for it."""
        if self.open:
            super().refused(version, error)

    def open_window(self) -> None:
        """vLLM's update window opens: take one sync. No refusal from before it belongs to it."""
        with self._changed:
            self._refused = None
            self.open = True

    def _start(self) -> None:
        if self._pending is None:
            return
        plan, version = self._pending
        self._pending = None
        self._require_open(version)
        super().begin(plan, version)

    def _require_open(self, version: int) -> None:
        if not self.open:
            raise SinkError(
                f"version {version} refused: no weight update is open on this vLLM worker "
                "(the trainer calls start_weight_update before it pushes)"
            )


def served_model_names(model_config: Any) -> tuple[str, ...]:
    """The names vLLM serves the base model under (`--served-model-name`, else the model)."""
    names = model_config.served_model_name or model_config.model
    return (names,) if isinstance(names, str) else tuple(names)


class _LoraVersions:
    """The LoRA adapters this worker holds in memory (vLLM loads them from there at any step),
    until the server says no request runs on them any more."""

    def __init__(self, memory: LoraMemory, layout: CheckpointLayout, model_names: tuple[str, ...]) -> None:
        self.memory = memory
        self.model_names = model_names
        """The names the server serves the base model under, which no adapter may take."""
        self._linears = {  # the checkpoint's linear layers: what an adapter's shapes must fit
            name.removesuffix(".weight"): (shape[1], shape[0])
            for name, (shape, _) in layout.tensors.items()
            if name.endswith(".weight") and len(shape) == 2
        }

    def hold(self, adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> tuple[int, str, str]:
        """Hold `tensors` as a version of `adapter`; its (LoRA id, lora_path, content digest).
        The id is drawn from the adapter's name, version and content: the same on every worker,
        and new for new weights (a reused name never reaches a stale cache entry)."""
        content = source_digest(tensors)
        lora_id = (
            int(xxhash.xxh3_64_hexdigest(f"{adapter.name}/{version}/{content}".encode())[:8], 16) % (2**31 - 1) + 1
        )
        config = {
            "r": adapter.rank,
            "lora_alpha": adapter.alpha,
            "target_modules": list(adapter.target_modules),
            "use_rslora": adapter.use_rslora,
        }
        self.memory.models[lora_id] = self.memory.build(lora_id, tensors, config)
        return lora_id, f"{MEMORY_SCHEME}{adapter.name}/{version}/{lora_id}", content

    def drop(self, *lora_ids: int) -> None:
        for lora_id in lora_ids:
            self.memory.models.pop(lora_id, None)

    def check(self, plan: Plan, adapter: Adapter) -> None:
        check_lora(plan, adapter, self._linears, self.memory.max_rank)
        unsupported = sorted(set(adapter.target_modules) - self.memory.supported_modules())
        if unsupported:
            raise PlanError(f"adapter {adapter.name!r}: vLLM has no LoRA layer for {unsupported} in this model")


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
        return_large_frees_to_os()  # each reload frees a model's worth of layer temporaries
        start = Start.from_json(init_info.start)
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        layout = checkpoint_layout(self.model_config.model, self.model_config.dtype)
        timeout = start.options(rank).timeout
        self._sink = _WindowSink(layout, timeout=timeout, deferred=bool(start.bell), kept=self._kept(layout))
        inner: WeightSink = StagedSink(self._sink, whole=True) if start.staged else self._sink
        loras = None
        if start.bell and start.lora_versions:
            memory = LoraMemory(self.model)
            serve_loras_from_memory(memory)
            loras = _LoraVersions(memory, layout, served_model_names(self.model_config))
        try:
            self._receiver = start_receiver(start, inner, rank=rank, weight_bytes=layout.total_bytes, loras=loras)
        except BaseException:
            self.shutdown()
            raise

    def _kept(self, layout: CheckpointLayout) -> tuple[Want, ...]:
        """The box of each tensor this worker keeps (`kept_boxes`); none (every tensor whole)
        where the dry run fails."""
        try:
            with checkpoint_format_on_meta(self.model):
                kept = kept_boxes(lambda name, tensor: self.model.load_weights([(name, tensor)]), layout)
        except Exception as exc:  # a model whose loaders cannot be dry-run: sent whole, as before
            log.warning(
                "this worker takes whole tensors: its loaders could not be dry-run (%s: %s)", type(exc).__name__, exc
            )
            return ()
        whole = len(layout.tensors) - len(kept)
        log.info("this worker keeps a box of %d checkpoint tensors; %d are sent whole", len(kept), whole)
        return kept

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        sink = self._require()
        initialize_layerwise_reload(self.model)
        self._reloading = True
        reuse_freed_memory()  # each layer reuses what the last one freed, rather than fault in fresh pages
        sink.open_window()

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
            buffers, copied = ReloadBuffers(self.model), 0
            with sink.stream(version=update_info.version) as stream:
                for batch in stream.batches():
                    self.model.load_weights(sink.loads(batch))
                    copied += buffers.own(batch)  # the receiver reuses the batch's memory next
            log.info("version %d landed; %d bytes of layers spanning buckets copied", update_info.version, copied)
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
        if self._reloading:  # a window left open: its allocations go back to mmap
            release_freed_memory()

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._reloading:  # ended already, by a sync that failed
            return
        self._reloading = False
        try:
            experts = cpu_experts_to_prepack(self.model)
            finalize_layerwise_reload(self.model, self.model_config)
            reprocess_tied_layers(self.model)
            prepack_cpu_experts(experts)
        finally:
            release_freed_memory()  # the sync's temporaries go back to the OS

    def _require(self) -> _WindowSink:
        if self._sink is None:
            raise SinkError("weightsync's transfer engine is not initialised: call init_weight_transfer_engine")
        return self._sink
