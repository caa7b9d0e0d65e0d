"""The sink every worker of a rollout server lands syncs through: the engine's own sink, with the
server's sync control rung around it (serving/control.py), whatever the engine.

    begin    the engine's sink checks the plan (a refused plan rings nothing), then `PushArrived`; with
             `park` (a sync that writes the served weights) the control pauses generation and
             opens the engine's update window before it answers
    commit   a staged sync rings `TransferDone` first (the window opens only now); the engine's sink
             commits; then `VersionLanded`, answered once every worker's outcome is in: refused unless
             every worker landed the version
    abort    the engine's sink aborts; then `VersionFailed`, saying whether this worker's served weights
             are intact
    observe  every change of the worker's receiver state goes to the control as `ReceiverChanged`

A LoRA adapter's sync lands in fresh tensors while the engine serves (`AdapterLanding`): at commit
the worker holds the adapter in memory (`LoraStore.hold`) and rings `AdapterLanded`; the control
has the engine take it once every worker holds it, and says which older versions the worker may
drop.

`Bell` is how a worker reaches its control: the workers of vLLM and SGLang ring the doorbell of
the API process (doorbell.py), the transformers engine's receiver calls its control in process
(`LocalBell`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from weightsync.errors import PlanError, SinkError
from weightsync.lora import Adapter, AdapterSink, check_name
from weightsync.messages import Plan
from weightsync.receiver import ReceiverStatus
from weightsync.sink import WeightSink, WrappingSink
from weightsync.workers import events

__all__ = ["AdapterLanding", "Bell", "ControlledSink", "LocalBell", "LoraStore"]

log = logging.getLogger(__name__)

Bell = Callable[[events.SyncEvent, float], events.Reply]
"""Ring the control with an event, waiting at most the given seconds: its reply when ok.
Raises SinkError when the control refused the event or did not answer."""


class Control(Protocol):
    """What a `LocalBell` rings: a server's sync control (serving/control.py), on its own loop."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    async def on_event(self, event: events.SyncEvent) -> events.Reply | None: ...


class LocalBell:
    """A `Bell` for a control in this process, on its own event loop (the transformers engine)."""

    def __init__(self, control: Control) -> None:
        self.control = control

    def __call__(self, event: events.SyncEvent, timeout: float) -> events.Reply:
        future = asyncio.run_coroutine_threadsafe(self.control.on_event(event), self.control.loop)
        try:
            reply = future.result(timeout)
        except TimeoutError as exc:
            future.cancel()
            raise SinkError(f"the server did not answer {events.event_name(event)!r} within {timeout} s") from exc
        except SinkError:
            raise
        except Exception as exc:  # the control refused it: the sync fails here with its reason
            raise SinkError(str(exc)) from exc
        return reply or events.Reply(ok=True)


class LoraStore(Protocol):
    """Where a worker holds the LoRA adapter versions it landed, until the engine drops them."""

    model_names: tuple[str, ...]
    """The names the base model is served under, which no adapter may take."""

    def check(self, plan: Plan, adapter: Adapter) -> None:
        """Raise PlanError when the adapter's plan does not fit the engine."""

    def hold(self, adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> tuple[int, str, str]:
        """Hold a landed version; its (engine LoRA id, path the engine loads it from, content digest).
        The id is the same on every worker for the same adapter, version and content."""

    def drop(self, *lora_ids: int) -> None: ...


class ControlledSink(WrappingSink):
    """A worker's sink under a rollout server (module docstring).

    Args:
        inner: where the sync lands (the engine's sink, staged or not).
        bell: how this worker reaches the server's control.
        rank: this worker's rank, named in every ring.
        drain_timeout: seconds the server may take to pause generation.
        timeout: seconds any other ring may take.
        loras: where LoRA adapters land (None: this server refuses them).
    """

    def __init__(
        self,
        inner: WeightSink,
        bell: Bell,
        *,
        rank: int,
        drain_timeout: float,
        timeout: float,
        loras: LoraStore | None = None,
    ) -> None:
        super().__init__(inner)
        self.bell = bell
        self.rank = rank
        self.drain_timeout = drain_timeout
        self.timeout = timeout
        self.loras = loras

    def adapter_sink(self, adapter: Adapter) -> WeightSink:
        if self.loras is None:
            raise PlanError(
                f"this server serves no LoRA adapters (start it with --max-lora-rank N); adapter {adapter.name!r} refused"
            )
        check_name(adapter, self.loras.model_names)
        return AdapterLanding(adapter, self, self.loras)

    def begin(self, plan: Plan, version: int) -> None:
        self.inner.begin(plan, version)  # a refused plan opens nothing
        park = not self.traits.staged
        event = events.PushArrived(
            version=version,
            rank=self.rank,
            total_bytes=plan.total_bytes,
            bucket_bytes=plan.bucket_bytes,
            park=park,
        )
        self.paused_s = self.timed_ring(event, self.drain_timeout + self.timeout if park else self.timeout)

    def commit(self, version: int) -> None:
        if self.traits.staged:
            self.paused_s = self.timed_ring(
                events.TransferDone(version=version, rank=self.rank), self.drain_timeout + self.timeout
            )
        self.inner.commit(version)  # the last tensors land; this worker's update call returns
        # Answered once every worker's outcome is in and the engine finished: the control waits up
        # to twice its own timeout plus the drain timeout (control.py); this ring waits longer.
        self.bell(events.VersionLanded(version=version, rank=self.rank), self.drain_timeout + 3 * self.timeout)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        try:
            self.inner.abort(version, error, intact=intact)
        finally:
            event = events.VersionFailed(version=version, rank=self.rank, intact=intact, error=str(error))
            try:
                self.bell(event, self.drain_timeout + 3 * self.timeout)  # answered once the server decided
            except SinkError as exc:  # the sync fails anyway; the server's wait for this worker ends in its timeout
                log.warning("could not tell the server that version %d failed here: %s", version, exc)

    def observe(self, before: ReceiverStatus, after: ReceiverStatus) -> None:
        """Receiver status changes go to the control (/weight_info, /health, metrics)."""
        status = events.ReceiverChanged(
            rank=self.rank,
            state=after.state,
            receiver_version=after.version,
            content_digest=after.content_digest,
            last_error=after.last_error,
            times=after.times,
            mode=after.mode,
        )
        try:
            self.bell(status, self.timeout)
        except SinkError as exc:
            log.warning("could not tell the server this worker's receiver state: %s", exc)

    def timed_ring(self, event: events.SyncEvent, timeout: float) -> float:
        """Ring the control; the seconds its answer took."""
        started = time.perf_counter()
        self.bell(event, timeout)
        return time.perf_counter() - started


class AdapterLanding(AdapterSink):
    """One adapter sync on a worker: landed in fresh tensors, held in memory (`LoraStore`) at
    commit, then served once every worker holds it (the control answers the ring); a refusal
    drops it here too."""

    def __init__(self, adapter: Adapter, served: ControlledSink, loras: LoraStore) -> None:
        super().__init__(adapter, loras.check, self._install)
        self.served = served
        self.loras = loras

    def _install(self, adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> None:
        lora_id, path, content = self.loras.hold(adapter, version, tensors)
        event = events.AdapterLanded(
            adapter=adapter, version=version, rank=self.served.rank, lora_id=lora_id, path=path, content_digest=content
        )
        try:
            reply = self.served.bell(event, 4 * self.served.timeout)  # the control waits up to 3 timeouts
        except BaseException:
            self.loras.drop(lora_id)
            raise
        self.loras.drop(*(retired for retired in reply.retired if retired != lora_id))

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        super().abort(version, error, intact=intact)
        event = events.AdapterFailed(name=self.adapter.name, version=version, rank=self.served.rank, error=str(error))
        try:
            self.served.bell(event, self.served.timeout)
        except SinkError as exc:
            log.warning("could not tell the server that adapter %r failed here: %s", self.adapter.name, exc)
