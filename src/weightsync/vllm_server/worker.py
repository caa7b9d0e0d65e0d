"""weightsync's receiver inside vLLM's worker, where the weights are.

`WorkerExtension` is handed to vLLM as `worker_extension_cls` (an engine argument vLLM offers
for exactly this: methods mixed into its worker, reached with `collective_rpc`). The API process
calls `weightsync_start_receiver` once the engine is up; from then on the trainer's
`WeightSender` pushes straight into this process, and each sync lands through vLLM's own
layerwise reload (`ReloadSink`, or `StagedSink` around it) with no copy through the API process.

A sync must never land while a forward pass runs, and only the API process can pause vLLM's
scheduler, so the sink rings the API process's doorbell (doorbell.py) at each step::

    begin   check the plan (PlanError: nothing paused), then "begin": the API process pauses
            generation in the sync mode and answers once nothing runs (staged: pauses later)
    commit  (staged: "park" first) vLLM reloads, then "commit": the API process labels the new
            version in vLLM and resumes
    abort   "abort" with whether the served weights are intact: resume, or stay paused as dirty
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from weightsync.engines.vllm_sink import ReloadSink
from weightsync.errors import SinkError
from weightsync.integrations.vllm.layout import checkpoint_layout, reprocess_tied_layers
from weightsync.options import ReceiverOptions
from weightsync.receiver import ReceiverStatus, WeightReceiver
from weightsync.sink import StagedSink, WeightSink, WrappingSink
from weightsync.types import Plan
from weightsync.vllm_server.doorbell import ring
from weightsync.vllm_server.events import Abort, Begin, Commit, Park, Status

__all__ = ["BellSink", "ReceiverSpec", "WorkerExtension"]

log = logging.getLogger(__name__)

EXTENSION = "weightsync.vllm_server.worker.WorkerExtension"
"""What the API process passes as vLLM's `worker_extension_cls`."""


class ReceiverSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker's receiver needs, sent by the API process as JSON through collective_rpc."""

    model: str
    transport: str
    bell: str
    """The doorbell's socket path."""
    staged: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    verify: str = "off"
    auth_token: str | None = None
    sync_timeout: float = 60.0
    drain_timeout: float = 60.0


class BellSink(WrappingSink):
    """The engine's sink, with the API process asked to pause around the part that touches vLLM.

    Args:
        inner: `ReloadSink`, or `StagedSink(ReloadSink)` for --staged.
        bell: the doorbell's socket path.
        drain_timeout: seconds the API process may take to pause generation.
        timeout: seconds any other doorbell event may take.
    """

    def __init__(self, inner: WeightSink, bell: str, *, drain_timeout: float, timeout: float) -> None:
        super().__init__(inner)
        self.bell = bell
        self.drain_timeout = drain_timeout
        self.timeout = timeout

    def begin(self, plan: Plan, version: int) -> None:
        self.inner.begin(plan, version)  # a refused plan pauses nothing
        park = not self.staged
        event = Begin(version=version, total_bytes=plan.total_bytes, bucket_bytes=plan.bucket_bytes, park=park)
        started = time.perf_counter()
        ring(self.bell, event, self.drain_timeout + self.timeout if park else self.timeout)
        self._paused_s = time.perf_counter() - started if park else 0.0

    def commit(self, version: int) -> None:
        if self.staged:
            started = time.perf_counter()
            ring(self.bell, Park(version=version), self.drain_timeout + self.timeout)
            self._paused_s = time.perf_counter() - started
        self.inner.commit(version)
        ring(self.bell, Commit(version=version), self.timeout)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        try:
            self.inner.abort(version, error, intact=intact)
        finally:
            try:
                ring(self.bell, Abort(version=version, intact=intact, error=str(error)), self.timeout)
            except SinkError as exc:  # the sync fails anyway; the API process learns from /health's next status
                log.warning("could not tell the API process that version %d failed: %s", version, exc)

    def observe(self, before: ReceiverStatus, after: ReceiverStatus) -> None:
        """Receiver status changes go to the API process (/weight_info, /health, metrics)."""
        status = Status(
            state=after.state,
            receiver_version=after.version,
            content_digest=after.content_digest,
            last_error=after.last_error,
            times=after.times,
            mode=after.mode,
        )
        try:
            ring(self.bell, status, self.timeout)
        except SinkError as exc:
            log.warning("could not tell the API process the receiver's state: %s", exc)


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self` is vLLM's worker.

    Method names start with `weightsync_`: vLLM refuses an extension whose names clash with the
    worker's own.
    """

    def weightsync_start_receiver(self, spec_json: str) -> dict[str, Any]:
        """Start the receiver (once); return the address senders connect to and the bytes of the
        weights a sync carries (in vLLM's dtype, counted from the checkpoint layout)."""
        started: dict[str, Any] | None = getattr(self, "_weightsync_started", None)
        if started is not None:
            return started
        spec = msgspec.json.decode(spec_json, type=ReceiverSpec)
        worker: Any = self
        layout = checkpoint_layout(spec.model, worker.model_config.dtype)
        loader = ReloadSink(
            layout,
            self._weightsync_reload,
            lambda: reprocess_tied_layers(worker.model_runner.get_model()),
            lambda dirty: None,  # the receiver and the API process track dirty weights
            spec.sync_timeout,
        )
        inner: WeightSink = StagedSink(loader) if spec.staged else loader
        sink = BellSink(inner, spec.bell, drain_timeout=spec.drain_timeout, timeout=spec.sync_timeout)
        options = ReceiverOptions(
            host=spec.host,
            port=spec.port,
            timeout=spec.sync_timeout,
            verify=spec.verify,  # type: ignore[arg-type]
            auth_token=spec.auth_token,
        )
        receiver = WeightReceiver(sink, spec.transport, options=options)
        receiver.watch(sink.observe)
        self._weightsync_receiver: WeightReceiver | None = receiver
        self._weightsync_started = {"address": receiver.address, "weight_bytes": layout.total_bytes}
        return self._weightsync_started

    def weightsync_stop_receiver(self) -> None:
        receiver: WeightReceiver | None = getattr(self, "_weightsync_receiver", None)
        self._weightsync_receiver = None
        if receiver is not None:
            receiver.close()

    def _weightsync_reload(self, weights: Any) -> None:
        worker: Any = self
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
