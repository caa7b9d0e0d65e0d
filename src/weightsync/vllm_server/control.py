"""The API process's side of syncs and pauses: who holds vLLM paused, which version it serves,
and what /health and /weight_info say.

vLLM has one pause switch (`AsyncLLM.pause_generation` / `resume_generation`); weightsync has
several owners of a pause (a user's POST /pause, a sync, dirty weights). Generation resumes when
the last owner lets go; a sync never resumes what a user paused.

The doorbell events of the worker's sink (worker.py, events.py) land in `on_event`:

    Begin   note the sync; with `park`, pause generation in the sync mode (bounded by the drain
            timeout: a sync that cannot park is refused, and nothing is paused)
    Park    pause for a staged sync's commit
    Commit  label the new version in vLLM (`update_weight_version`), then resume
    Abort   intact: resume the previous version; dirty: abort every request and stay paused,
            answering 503, until the next good sync
    Status  the receiver's state, digest, last error and phase times
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from weightsync.errors import SinkError
from weightsync.server.loop import PauseMode
from weightsync.server.metrics import ServerMetrics
from weightsync.server.runtime import Health
from weightsync.server.sync import SyncStats
from weightsync.vllm_server.events import Abort, Begin, Commit, Park, Status, SyncEvent

__all__ = ["SyncControl"]

log = logging.getLogger(__name__)


class SyncControl:
    """Pauses, version and sync state of one vLLM server.

    Args:
        engine: vLLM's `AsyncLLM`.
        mode: how a sync pauses generation ("wait", "abort" or "keep").
        drain_timeout: seconds a sync waits for generation to pause before it is refused.
        metrics: weightsync's metrics.
        version: the version served from the start (a checkpoint loaded), or None.
    """

    def __init__(
        self, engine: Any, *, mode: PauseMode, drain_timeout: float, metrics: ServerMetrics, version: int | None
    ) -> None:
        self.engine = engine
        self.mode = mode
        self.drain_timeout = drain_timeout
        self.metrics = metrics
        self.version = version
        self.dirty = False
        self.stats = SyncStats()
        self.receiver = Status()
        """The worker's receiver, as its last `Status` event said."""
        self.changed = asyncio.Event()
        """Set (and cleared at once) whenever the version or the dirty flag changes."""
        self._owners: dict[str, PauseMode] = {}
        self._pausing: asyncio.Future[None] | None = None
        self._started = 0.0
        if version is not None:
            metrics.version.set(version)

    # --- pauses ---------------------------------------------------------------------------------

    @property
    def paused_by(self) -> list[str]:
        return sorted(self._owners)

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
        if self._owners or self._pausing is None:
            return
        self._pausing = None
        await self.engine.resume_generation()

    # --- sync events ----------------------------------------------------------------------------

    async def on_event(self, event: SyncEvent) -> None:
        """One doorbell event from the worker's sink; raising refuses it (the sync then fails)."""
        match event:
            case Status():
                self._status(event)
            case Begin():
                self._begin(event)
                if event.park:
                    await self._park(event.version)
            case Park():
                await self._park(event.version)
            case Commit():
                await self._commit(event.version)
            case Abort():
                await self._abort(event.version, event.intact, event.error)

    def _begin(self, event: Begin) -> None:
        self._started = time.perf_counter()
        self.stats = self.stats.next(event.version, event.total_bytes, event.bucket_bytes, self.metrics)

    async def _park(self, version: int) -> None:
        if not await self.pause("sync", self.mode, self.drain_timeout):
            await self.resume("sync")
            raise SinkError(
                f"generation did not pause within {self.drain_timeout} s (sync mode {self.mode!r}); "
                f"version {version} refused"
            )

    async def _commit(self, version: int) -> None:
        await self.engine.update_weight_version(str(version))
        self.version = version
        self.dirty = False
        self._owners.pop("dirty", None)
        self.stats.committed(time.perf_counter() - self._started, self.metrics)
        await self.resume("sync")
        self._changed()
        log.info(
            "sync of version %d committed: %d bytes in %.3f s", version, self.stats.total_bytes, self.stats.seconds
        )

    async def _abort(self, version: int, intact: bool, error: str) -> None:
        self.stats.failed(time.perf_counter() - self._started, error, self.metrics)
        if not intact or self.dirty:  # the live weights are no version we can name: serve nothing
            self.dirty = True
            self.version = None
            self.metrics.version.set(-1)
            await self.pause("dirty", "abort", self.drain_timeout)
            self._changed()
        await self.resume("sync")
        log.warning(
            "sync of version %d failed: %s; %s",
            version,
            error,
            "the served weights are dirty until the next good sync" if self.dirty else "still serving",
        )

    def _status(self, status: Status) -> None:
        if status.times is not None and status.times != self.receiver.times:
            self.metrics.observe_times(status.times, status.mode)
        self.receiver = status

    def _changed(self) -> None:
        self.changed.set()
        self.changed.clear()

    # --- what the HTTP layer reads --------------------------------------------------------------

    def health(self, engine_dead: bool) -> Health:
        if engine_dead:
            return Health(False, "failed", "vLLM's engine died; restart the server")
        if self.dirty:
            reason = f"weights are dirty: {self.receiver.last_error or self.stats.error}; push a new version"
            return Health(False, "dirty", reason)
        syncing = self.receiver.state == "syncing"
        if self.version is None:
            if syncing:
                return Health(False, "syncing", "the first weight sync is in progress")
            reason = "no weights committed yet (started with --load-format dummy): push weights first"
            return Health(False, "waiting for weights", reason)
        return Health(True, "syncing" if syncing else "ready")

    def state(self) -> str:
        if self.dirty:
            return "dirty"
        state = self.receiver.state
        return "ready" if state == "empty" and self.version is not None else state

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
