"""The worker half: SGLang's custom weight loader, and a `WeightReceiver` in every TP worker.

A stock `python -m sglang.launch_server` started with::

    --custom-weight-loader weightsync.integrations.sglang.load_weights

calls `load_weights(model, named_tensors)` inside every TP worker (its scheduler process, on its
scheduler thread) for each `POST /update_weights_from_tensor` whose `load_format` names it. The
trainer (`SGLangEngine`) sends one control message per call (control.py)::

    Start     this worker starts a fresh receiver over the trainer's transport (rank r listens
              on port + r) and announces its address in the trainer's store (the worker kit:
              weightsync.workers.start)
    Land(N)   this worker lands version N: the receiver takes the whole push into a standby
              copy in host memory (StagedSink); once every byte arrived (and was verified),
              SGLang's own `model.load_weights` takes it a batch at a time on this thread (its
              loaders slice each TP shard, fuse q/k/v and gate/up); the worker then writes
              its `LandResult` into the trainer's store and returns

Why staged: SGLang's `load_weights` writes into the served weights and cannot undo a half
update, so a push that fails in transfer (the trainer died, a timeout, a bad checksum) must not
reach it. Why the plan is checked against the checkpoint's layout before any byte moves:
SGLang's loaders skip names they do not know and leave tensors nobody sent as they were, which
would serve a mix without a word.

Under `weightsync serve --engine sglang` the server is the trainer's counterpart: `Start`
names its doorbell (`bell`), and the worker's sink is a `ControlledSink` around the same stream
(staged or not, as the server says). A push then rings the server's control as it arrives; the
control pauses generation, opens SGLang's update session and sends `Land`; the worker lands the
version as above, and its commit or failure goes to the control through the doorbell, not the
store (weightsync.serving.control decides the version, as for every engine).

The loader never raises: an exception in a custom loader ends SGLang's scheduler process (and
the server), and with TP > 1 the other workers would wait in SGLang's barrier. Every failure is
logged, told to the trainer through the sender's report and the `LandResult`, and the loader
returns; SGLang's update call then succeeds, and the trainer labels no version.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from weightsync.errors import WeightSyncError, one_line
from weightsync.integrations.sglang.control import Land, LandResult, connect_store, decode, write_result
from weightsync.messages import Plan
from weightsync.receiver import WeightReceiver
from weightsync.sink import StagedSink, WeightSink
from weightsync.stream import StreamSink
from weightsync.workers.layout import CheckpointLayout, check_plan_layout, checkpoint_layout
from weightsync.workers.start import Start, start_receiver

__all__ = ["load_weights"]

log = logging.getLogger(__name__)


class _LayoutStream(StreamSink):
    """A `StreamSink` that takes only a plan matching the model's checkpoint layout."""

    def __init__(self, layout: CheckpointLayout, *, timeout: float) -> None:
        super().__init__(timeout=timeout)
        self.layout = layout
        self.feed: dict[str, str | None] = {}
        """The name each planned tensor is loaded under (None: a tied duplicate, not loaded)."""

    def begin(self, plan: Plan, version: int) -> None:
        self.feed = check_plan_layout(plan, self.layout)
        super().begin(plan, version)


@dataclasses.dataclass
class _Worker:
    """This TP worker's receiver, from one `Start` to the next."""

    rank: int
    session: str
    store: Any
    """A client of the trainer's store (torch.distributed.TCPStore); None under a server, whose
    control hears each outcome through its doorbell."""
    stream: _LayoutStream
    receiver: WeightReceiver

    def land(self, model: Any, version: int, timeout: float) -> LandResult:
        """Land `version` into `model` (module docstring); how it went."""
        self.stream.timeout = timeout
        touched = False
        try:
            with self.stream.stream(version=version) as tensors:
                for batch in tensors.batches():
                    touched = True
                    model.load_weights([(fed, tensor) for name, tensor in batch if (fed := self.stream.feed[name])])
        except Exception as exc:
            log.error("weightsync: version %d did not land on TP rank %d: %s", version, self.rank, one_line(exc))
            return LandResult(rank=self.rank, version=version, landed=False, touched=touched, error=one_line(exc))
        log.info("weightsync: version %d landed on TP rank %d", version, self.rank)
        return LandResult(rank=self.rank, version=version, landed=True, touched=True)

    def close(self) -> None:
        self.receiver.close()


_worker: _Worker | None = None
_sinks: tuple[_LayoutStream, StagedSink] | None = None
"""Kept from the first `Start` on: a trainer that connects again (or another) reuses the
standby copy rather than fault in a fresh one."""
_lock = threading.Lock()


def load_weights(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader (`--custom-weight-loader weightsync.integrations.sglang.load_weights`):
    runs the trainer's control message (module docstring). Never raises."""
    global _worker
    try:
        message = decode(named_tensors)
    except WeightSyncError as exc:
        log.error("weightsync's loader: %s", exc)
        return
    with _lock:
        if isinstance(message, Start):
            previous, _worker = _worker, None
            if previous is not None:
                previous.close()
            try:
                _worker = _connect(model, message)
            except Exception as exc:
                log.error("weightsync: this worker's receiver did not start: %s", one_line(exc))
            return
        _land(model, message)


def _land(model: Any, message: Land) -> None:
    worker = _worker
    if worker is None or worker.session != message.session:
        why = "no receiver" if worker is None else "another trainer connected since"
        log.error("weightsync: version %d refused: %s (the trainer connects first)", message.version, why)
        return
    landing = worker.land(model, message.version, message.timeout)
    if worker.store is None:  # under a server: the worker's sink told its control already
        return
    try:
        write_result(worker.store, worker.session, landing)
    except Exception as exc:  # the trainer then times out waiting for it, and labels nothing
        log.error("weightsync: could not tell the trainer how version %d went: %s", message.version, exc)


def _connect(model: torch.nn.Module, message: Start) -> _Worker:
    """Start this worker's receiver and announce it in the trainer's store."""
    from sglang.srt.runtime_context import get_parallel, get_server_args

    global _sinks
    rank = int(get_parallel().tp_rank)
    timeout = message.options(rank).timeout
    if _sinks is None:
        layout = checkpoint_layout(get_server_args().model_path, next(model.parameters()).dtype)
        stream = _LayoutStream(layout, timeout=timeout)
        _sinks = stream, StagedSink(stream)
    stream, staged = _sinks
    store = None if message.bell else connect_store(message.rendezvous, timeout)
    inner: WeightSink = staged if message.staged or not message.bell else stream  # a trainer's push lands staged
    receiver = start_receiver(message, inner, rank=rank, weight_bytes=stream.layout.total_bytes)
    return _Worker(rank=rank, session=message.session, store=store, stream=stream, receiver=receiver)
