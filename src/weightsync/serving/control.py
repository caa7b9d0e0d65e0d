"""One rollout server's sync control, whatever its engine: who holds generation paused, the
update window across the engine's workers, which version it serves, whether the weights are dirty,
and what /health and /weight_info say. Every engine adapter feeds it the same events (workers/events.py)
and supplies the small `Engine` protocol below; nothing else in a server decides any of this.

An engine has one pause switch (`pause_generation` / `resume_generation`); the control has several
owners of a pause (a user's POST /pause, a sync, dirty weights). Generation resumes when the last
owner lets go; a sync never resumes what a user paused.

Each worker's sink (workers/sink.py: `ControlledSink`) rings the control as a push reaches it: vLLM's
workers through the doorbell (a Unix socket), the transformers engine in process. `on_event`
answers:

    PushArrived      note the sync; with `park`, open the window (below)
    TransferDone     a staged sync's transfer is done on this worker: open the window
    VersionLanded    this worker landed the version: answered once the window is decided,
                     refused unless every worker landed it
    VersionFailed    this worker failed the sync: answered once the window is decided
    ReceiverChanged  this worker's receiver state, digest, last error and phase times

A LoRA adapter's sync needs no window and no pause: each worker lands it in memory and rings
`AdapterLanded`; once every worker holds it, the engine's `serve_lora` takes it on every worker,
the adapter's name routes to it, and every worker's ring is answered ok. Any worker failing (or
not answering within the sync timeout) refuses it on all, and the adapter's previous version
serves on. The newest `lora_versions` versions of each adapter stay served; an older one leaves
the engine once no request runs on it.

One window per version, opened once for every worker: pause generation in the sync mode (bounded
by the drain timeout: a sync that cannot park is refused, nothing paused), then the engine's
`start_weight_update` and `update_weights`. It is decided, by the one rule of every round (`weightsync.round.decide`,
docs/failure-semantics.md), once every worker's outcome is in (or the wait for one times out, or
the engine dies): the engine's `finish_weight_update` labels the version only when every worker
committed it; generation resumes when no worker's weights changed; otherwise the server stays
paused and answers 503 "dirty" until the next good sync: no response from a mix.

The control lives on one asyncio event loop (`loop`); `call` runs one of its coroutines from any
other loop, and its read-only views (`health`, `state`, `weight_info`) may be read from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import msgspec

from weightsync.errors import SinkError
from weightsync.lora import Adapter, AdapterVersion, ServedAdapter
from weightsync.report import moved
from weightsync.round import Outcome, WorkerState, decide
from weightsync.serving.config import Health, PauseMode
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.stats import Served, SyncStats
from weightsync.workers.events import (
    AdapterFailed,
    AdapterLanded,
    PushArrived,
    ReceiverChanged,
    Reply,
    SyncEvent,
    TransferDone,
    VersionFailed,
    VersionLanded,
)

__all__ = ["Engine", "SyncControl"]

log = logging.getLogger(__name__)

POLL_S = 1.0
"""How often a window's wait for the engine's update call looks whether the engine died."""


@dataclasses.dataclass(eq=False)
class _AdapterLanding:
    """One adapter version landing on every worker."""

    landed: dict[int, AdapterLanded] = dataclasses.field(default_factory=dict)
    decided: asyncio.Future[str] = dataclasses.field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Engine(Protocol):
    """What an engine adapter supplies to the control (vllm/server.py adapts vLLM's `AsyncLLM`,
    hf/server.py the transformers engine loop). Every call is made on the control's loop."""

    name: str
    """How messages name the engine ("vLLM", "transformers")."""

    @property
    def errored(self) -> bool:
        """The engine is gone for good (a worker process died): every request is refused."""

    def failure(self) -> str:
        """Why the engine cannot serve now ("" when it can): /health's "failed" reason."""

    async def pause_generation(self, *, mode: PauseMode) -> None: ...

    async def resume_generation(self) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, version: int) -> None:
        """Returns once every worker's reload of `version` ended (an engine whose syncs land
        without a reload call returns at once)."""

    async def finish_weight_update(self, version: int | None) -> None:
        """End the window; label the engine's outputs with `version` from now on (None: the
        sync failed, the label stays)."""

    async def serve_lora(self, name: str, lora_id: int, path: str) -> None:
        """Load LoRA adapter `lora_id` on every worker (from `path`), and route requests for
        `name` to it."""

    async def remove_lora(self, lora_id: int) -> None: ...


@dataclasses.dataclass(eq=False)
class _Window:
    """The engine's update window for one version, across every worker."""

    version: int
    opening: asyncio.Future[None] = dataclasses.field(init=False)
    """Pausing generation, then the engine's start call on every worker."""
    reloading: bool = False
    """The engine's start call was made: a reload may have begun on some worker."""
    outcomes: dict[int, VersionLanded | VersionFailed] = dataclasses.field(default_factory=dict)
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    decided: asyncio.Future[str] = dataclasses.field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """"" once the version is labelled, else why it was not."""


class SyncControl:
    """Pauses, version and sync state of one rollout server (module docstring).

    Args:
        engine: the engine adapter, as `Engine`.
        workers: how many workers each sync must reach (tensor x pipeline parallel size).
        mode: how a sync pauses generation ("wait", "abort" or "keep").
        drain_timeout: seconds a sync waits for generation to pause before it is refused.
        sync_timeout: seconds the window waits for a worker's outcome once the engine's update
            call returned, and for its finish call.
        metrics: weightsync's metrics.
        version: the version served from the start (a checkpoint loaded), or None.
        lora_versions: versions of each LoRA adapter kept resident (0: adapters are refused).
        busy: whether a request still runs on an adapter version (by its engine id): one that
            does leaves the engine at a later push.
        loop: the event loop the control lives on (default: the one running where it is first used).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        workers: int = 1,
        mode: PauseMode,
        drain_timeout: float,
        sync_timeout: float = 60.0,
        metrics: ServerMetrics,
        version: int | None,
        lora_versions: int = 0,
        busy: Callable[[int], bool] = lambda engine_id: False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._loop = loop
        self.engine = engine
        self.workers = workers
        self.mode = mode
        self.drain_timeout = drain_timeout
        self.sync_timeout = sync_timeout
        self.metrics = metrics
        self.version = version
        self.last_committed = version
        """The version served last, kept while dirty (/weight_info's `last_committed`): a push's
        default version is above it, and every worker's receiver refuses one at or below the
        last it committed."""
        self.dirty = False
        self.stats = SyncStats()
        self.receivers: dict[int, ReceiverChanged] = {}
        """Each worker's receiver, as its last `ReceiverChanged` event said."""
        self.changed = asyncio.Event()
        """Set (and cleared at once) whenever the version or the dirty flag changes."""
        self._owners: dict[str, PauseMode] = {}
        self._pausing: asyncio.Future[None] | None = None
        self._window: _Window | None = None
        self._counting: int | None = None
        """The version whose sync the stats count now (None: no sync in progress)."""
        self._started = 0.0
        self.lora_versions = lora_versions
        self.adapters: dict[str, ServedAdapter] = {}
        """The LoRA adapters served, by name (their engine ids are the engine's LoRA ids)."""
        self._landing: dict[tuple[str, int, int], _AdapterLanding] = {}
        """Adapter versions landing now, by (name, version, LoRA id)."""
        self._adapter_failures: dict[tuple[str, int], str] = {}
        self._busy = busy
        self._retiring: set[int] = set()
        """LoRA ids of versions no longer served, still in the engine until no request runs on them."""
        self._retired: collections.deque[int] = collections.deque(maxlen=1024)
        """LoRA ids gone from the engine, which the workers may drop (told in every `AdapterLanded` reply)."""
        self._deciding: set[asyncio.Task[None]] = set()
        self._closed = False
        if version is not None:
            metrics.version.set(version)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the control lives on."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def close(self) -> None:
        """The server is stopping: end the decisions in progress and call the engine no more (its engine
        is about to go, and a call into it then would wait for ever)."""
        self._closed = True
        for task in list(self._deciding):
            task.cancel()

    def _decide_in_background(self, decision: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(decision)
        self._deciding.add(task)
        task.add_done_callback(self._deciding.discard)

    @property
    def receiver(self) -> ReceiverChanged:
        """The first worker's receiver (every worker receives the same sync)."""
        return self.receivers.get(min(self.receivers, default=0), ReceiverChanged())

    # --- pauses ---------------------------------------------------------------------------------

    @property
    def paused_by(self) -> dict[str, PauseMode]:
        """Who holds generation paused, and in which mode."""
        return dict(sorted(self._owners.items()))

    async def pause(self, owner: str, mode: PauseMode, timeout: float) -> bool:
        """Hold generation paused for `owner`; True once nothing runs, False if that took longer
        than `timeout` (the pause stays held: call `resume(owner)`). The first owner's mode
        pauses; a later "abort" also ends what an earlier "keep" froze."""
        self._owners[owner] = mode
        if self._pausing is None or mode == "abort":
            self._pausing = asyncio.ensure_future(self.engine.pause_generation(mode=mode))
        try:
            await asyncio.wait_for(asyncio.shield(self._pausing), timeout)
        except TimeoutError:
            return False
        return True

    async def resume(self, owner: str) -> None:
        """Let go of `owner`'s pause; generation resumes when nobody else holds one."""
        self._owners.pop(owner, None)
        if self._owners or self._pausing is None or self._closed:
            return
        self._pausing = None
        await self.engine.resume_generation()

    # --- sync events ----------------------------------------------------------------------------

    async def on_event(self, event: SyncEvent) -> Reply | None:
        """One doorbell event from a worker's sink; raising refuses it (the sync then fails there)."""
        match event:
            case ReceiverChanged():
                self._status(event)
            case PushArrived():
                self._begin(event)
                if event.park:
                    await self._open(event.version)
            case TransferDone():
                await self._open(event.version)
            case VersionLanded() | VersionFailed():
                await self._outcome(event)
            case AdapterLanded():
                await self._adapter_landed(event)
                return Reply(ok=True, retired=tuple(self._retired))
            case AdapterFailed():
                self._adapter_failed(event)
        return None

    def _begin(self, event: PushArrived) -> None:
        window = self._window
        if window is not None and window.version != event.version and not window.decided.done():
            raise SinkError(f"version {event.version} refused: the sync of version {window.version} is in progress")
        if self._counting != event.version:
            self._counting = event.version
            self._started = time.perf_counter()
            self.stats = self.stats.next(event.version, event.total_bytes, event.bucket_bytes, self.metrics)

    async def _open(self, version: int) -> None:
        """Open the window of `version` (once, whichever worker asks first; again for a push of
        a version whose window was decided: a retry) and wait until it is."""
        window = self._window
        if window is None or window.version != version or window.decided.done():
            if window is not None and not window.decided.done():
                raise SinkError(f"version {version} refused: the sync of version {window.version} is in progress")
            window = self._window = _Window(version)
            window.opening = asyncio.ensure_future(self._open_window(window))
            self._decide_in_background(self._decide(window))
        await asyncio.shield(window.opening)

    async def _open_window(self, window: _Window) -> None:
        if not await self.pause("sync", self.mode, self.drain_timeout):
            raise SinkError(
                f"generation did not pause within {self.drain_timeout} s (sync mode {self.mode!r}); "
                f"version {window.version} refused"
            )
        window.reloading = True
        await self.engine.start_weight_update()  # every worker's layerwise reload begins

    async def _outcome(self, event: VersionLanded | VersionFailed) -> None:
        window = self._window
        if window is None or window.version != event.version or window.decided.done():
            if isinstance(event, VersionLanded):
                raise SinkError(f"commit of version {event.version} refused: no update window is open for it")
            self._failed_before_the_window(event)  # refused at begin, or a staged transfer that failed
            return
        window.outcomes[event.rank] = event
        window.changed.set()
        # Answered once decided, so that a sender's push returns (or fails) only after the
        # server serves its outcome. The worker's ring waits longer than this (worker.py).
        why = await asyncio.wait_for(asyncio.shield(window.decided), 2 * self.sync_timeout + self.drain_timeout)
        if why and isinstance(event, VersionLanded):
            raise SinkError(why)

    async def _adapter_landed(self, event: AdapterLanded) -> None:
        key = (event.adapter.name, event.version, event.lora_id)
        landing = self._landing.get(key)
        if landing is None:
            landing = self._landing[key] = _AdapterLanding()
            self._decide_in_background(self._decide_adapter(key, landing))
        landing.landed[event.rank] = event
        why = await asyncio.wait_for(asyncio.shield(landing.decided), 3 * self.sync_timeout)
        if why:
            raise SinkError(why)

    def _adapter_failed(self, event: AdapterFailed) -> None:
        self._adapter_failures[(event.name, event.version)] = f"worker {event.rank}: {event.error}"

    async def _decide_adapter(self, key: tuple[str, int, int], landing: _AdapterLanding) -> None:
        name, version, lora_id = key
        why = ""
        try:
            deadline = time.monotonic() + self.sync_timeout
            while len(landing.landed) < self.workers and not why:
                why = self._adapter_failures.pop((name, version), "")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.workers)) - set(landing.landed))
                    why = f"worker(s) {missing} did not land adapter {name!r} version {version} within {self.sync_timeout} s"
                await asyncio.sleep(0.01)
            if not why and not self.lora_versions:
                why = "this server serves no LoRA adapters (start it with --max-lora-rank N)"
            if not why:
                first = landing.landed[min(landing.landed)]
                await asyncio.wait_for(self.engine.serve_lora(name, lora_id, first.path), self.sync_timeout)
                await self._served(first.adapter, AdapterVersion(version, first.content_digest, str(lora_id)))
        except Exception as exc:
            why = (
                why
                or f"{self.engine.name} did not take adapter {name!r} version {version}: {type(exc).__name__}: {exc}"
            )
        finally:
            if why:
                log.warning(
                    "sync of adapter %r version %d failed: %s; still serving the previous one", name, version, why
                )
            if not landing.decided.done():
                landing.decided.set_result(why)
            self._landing.pop(key, None)

    async def _served(self, adapter: Adapter, fresh: AdapterVersion) -> None:
        """`fresh` serves adapter `adapter` from now on; versions past the newest
        `lora_versions` (and all of a previous config's) leave the engine."""
        before = self.adapters.get(adapter.name)
        versions = (*before.versions, fresh) if before is not None and before.adapter == adapter else (fresh,)
        kept = versions[-self.lora_versions :]
        self.adapters[adapter.name] = ServedAdapter(adapter, kept)
        log.info("adapter %r version %d served on %d worker(s)", adapter.name, fresh.version, self.workers)
        dropped = {v.engine_id for v in (*(before.versions if before is not None else ()), *versions)}
        self._retiring.update(int(engine_id) for engine_id in dropped - {v.engine_id for v in kept})
        for lora_id in sorted(self._retiring):
            if self._busy(lora_id):
                continue  # a request still runs on it: it leaves at a later push
            self._retiring.discard(lora_id)
            with contextlib.suppress(Exception):  # still held by the engine (vLLM's LRU cache evicts it in time)
                await self.engine.remove_lora(lora_id)
            self._retired.append(lora_id)

    def _failed_before_the_window(self, event: VersionFailed) -> None:
        if self._counting != event.version:
            return  # counted already (another worker's abort)
        self._counting = None
        self.stats.failed(time.perf_counter() - self._started, event.error, self.metrics)
        log.warning("sync of version %d failed on worker %d: %s; still serving", event.version, event.rank, event.error)

    async def _decide(self, window: _Window) -> None:
        """Wait for every worker's outcome, then label the version or refuse it (module docstring)."""
        why = ""
        try:
            try:
                await window.opening
                why = await self._wait_update(asyncio.ensure_future(self.engine.update_weights(window.version)))
            except Exception as exc:
                why = f"{self.engine.name}'s update window did not open: {exc}"
            started = window.reloading  # a start call that failed on some worker still needs its finish
            if not await self._wait_outcomes(window) and not why:
                missing = sorted(set(range(self.workers)) - set(window.outcomes))
                why = f"no outcome from worker(s) {missing} within {self.sync_timeout} s"
            failed = [o for o in window.outcomes.values() if isinstance(o, VersionFailed)]
            if failed and not why:
                why = "; ".join(f"worker {o.rank}: {o.error}" for o in sorted(failed, key=lambda o: o.rank))
            states = self._states(window, started)
            outcome = decide(states, [why], was_ready=not self.dirty)
            if outcome.verdict == "label":
                why = await self._finish(window.version)
                if not why:
                    self._committed(window.version)
                    return
                outcome = decide(states, [why], was_ready=not self.dirty)
            elif started:
                await self._finish(None)
            why = outcome.why
            await self._failed(window.version, outcome)
        except Exception as exc:  # never leave a worker's commit waiting on an undecided window
            why = why or f"the sync could not be decided: {exc}"
            log.exception("deciding version %d", window.version)
        finally:
            with contextlib.suppress(Exception):  # an engine that died cannot resume
                await self.resume("sync")
            if not window.decided.done():
                window.decided.set_result(why)

    def _states(self, window: _Window, started: bool) -> list[WorkerState]:
        """Each worker's weights after the window (`weightsync.round.decide`): a worker that rang
        no outcome is unknown once the reload may have begun, else intact."""
        states: list[WorkerState] = []
        for rank in range(self.workers):
            outcome = window.outcomes.get(rank)
            if outcome is None:
                states.append("unknown" if started else "intact")
            elif isinstance(outcome, VersionLanded):
                states.append("landed")
            else:
                states.append("intact" if outcome.intact else "changed")
        return states

    async def _wait_update(self, update: asyncio.Future[None]) -> str:
        """Wait for the engine's update call on every worker (each bounded by its receiver's timeouts);
        returns why it failed, "" if it did not."""
        while not update.done():
            try:
                await asyncio.wait([update], timeout=POLL_S)
            except asyncio.CancelledError:  # the server stops (`close`)
                update.cancel()
                raise
            if self.engine.errored:
                update.cancel()
                return f"{self.engine.name}'s engine died during the sync"
        error = update.exception()
        return "" if error is None else f"{self.engine.name}'s update_weights failed: {error}"

    async def _wait_outcomes(self, window: _Window) -> bool:
        deadline = time.monotonic() + self.sync_timeout
        while len(window.outcomes) < self.workers and not self.engine.errored:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            window.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(window.changed.wait(), min(left, POLL_S))
        return len(window.outcomes) >= self.workers

    async def _finish(self, version: int | None) -> str:
        """The engine's finish call (labelling `version`, if any); returns why it failed, "" if not."""
        try:
            await asyncio.wait_for(self.engine.finish_weight_update(version), self.sync_timeout)
        except Exception as exc:
            return f"{self.engine.name}'s finish_weight_update failed: {type(exc).__name__}: {exc}"
        return ""

    def _committed(self, version: int) -> None:
        self.version = self.last_committed = version
        self.dirty = False
        self._owners.pop("dirty", None)
        self._counting = None
        self.stats.committed(time.perf_counter() - self._started, self.metrics)
        self._changed()
        log.info(
            "sync of version %d committed on %d worker(s): %s",
            version,
            self.workers,
            moved(self.stats.total_bytes, self.stats.seconds),
        )

    async def _failed(self, version: int, outcome: Outcome) -> None:
        error = outcome.why
        self._counting = None
        self.stats.failed(time.perf_counter() - self._started, error, self.metrics)
        if not outcome.ready:  # the live weights are no version we can name: serve nothing
            self.dirty = True
            self.version = None
            self.metrics.version.set(-1)
            self._changed()  # the gate refuses from now on, whatever the pause below does
            with contextlib.suppress(Exception):  # an engine that died cannot pause: nothing runs anyway
                await self.pause("dirty", "abort", self.drain_timeout)
        log.warning(
            "sync of version %d failed: %s; %s",
            version,
            error,
            "the served weights are dirty until the next good sync" if self.dirty else "still serving",
        )

    def _status(self, status: ReceiverChanged) -> None:
        before = self.receivers.get(status.rank)
        if status.rank == min(self.receivers.keys() | {status.rank}) and status.times is not None:
            if before is None or status.times != before.times:
                self.metrics.observe_times(status.times, status.mode)
        self.receivers[status.rank] = status

    def _changed(self) -> None:
        self.changed.set()
        self.changed.clear()

    # --- what the HTTP layer reads --------------------------------------------------------------

    def health(self) -> Health:
        failure = self.engine.failure()
        if failure:
            return Health(False, "failed", failure)
        if self.dirty:
            reason = f"weights are dirty: {self.receiver.last_error or self.stats.error}; push a new version"
            return Health(False, "dirty", reason)
        syncing = self._syncing()
        if self.version is None:
            if syncing:
                return Health(False, "syncing", "the first weight sync is in progress")
            reason = "no weights committed yet (started with --load-format dummy): push weights first"
            return Health(False, "waiting for weights", reason)
        return Health(True, "syncing" if syncing else "ready")

    def state(self) -> str:
        if self.dirty:
            return "dirty"
        if self._syncing():
            return "syncing"
        state = self.receiver.state
        return "ready" if state == "empty" and self.version is not None else state

    def _syncing(self) -> bool:
        window = self._window
        open_window = window is not None and not window.decided.done()
        return open_window or any(status.state == "syncing" for status in self.receivers.values())

    def weight_info(self, served: Served) -> dict[str, Any]:
        """GET /weight_info: one schema for every engine."""
        receiver = self.receiver
        times = (
            None
            if receiver.times is None
            else {k: round(v, 6) for k, v in msgspec.structs.asdict(receiver.times).items()}
        )
        return {
            "version": self.version,
            "last_committed": self.last_committed,
            "state": self.state(),
            "last_error": receiver.last_error,
            "last_sync": self.stats.to_json() | {"times": times},
            "content_digest": receiver.content_digest,
            "transport": served.transport,
            "addresses": list(served.addresses),
            "sync_mode": self.mode,
            "paused_by": self.paused_by,
            "weight_bytes": served.weight_bytes,
            "workers": self.workers,
            "engine": served.engine,
            "model": served.model,
            "adapters": [adapter.to_json() for adapter in self.adapters.values()],
        }

    async def call(self, work: Awaitable[Any]) -> Any:
        """Await `work`, one of this control's coroutines, on the control's loop, from any loop."""
        if asyncio.get_running_loop() is self.loop:
            return await work
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop))  # type: ignore[arg-type]

    async def wait_servable(self, timeout: float) -> bool:
        """Wait up to `timeout` for a committed, intact version (the gate before the first sync)."""
        deadline = time.monotonic() + timeout
        while self.version is None or self.dirty:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return False
        return True
