"""The server's weight sink: the engine's own sink, with the engine loop paused around it.

begin   the engine's sink checks the plan (a refused plan pauses nothing), then the loop is
        paused in the server's sync mode and the sync lands while it is parked
commit  the engine's sink commits, the loop switches to the new version and resumes
        (a user's /pause stays in force: that pause has its own owner)
abort   told by the receiver whether the served weights are intact: intact weights resume the
        previous version; dirty ones (live weights partly written) stop serving until the next
        good sync

A LoRA adapter's sync lands while the engine serves; the loop is parked in keep mode (requests
in flight stay where they are) only while the engine takes the adapter, at commit.

Every sync is one line in the server's log (version, bytes, seconds, outcome), and so is every
push the engine refuses, with its reason.
"""

from __future__ import annotations

import logging
import time

from weightsync.errors import SinkError
from weightsync.lora import check_name
from weightsync.messages import Adapter, Plan
from weightsync.report import moved
from weightsync.serving.config import PauseMode
from weightsync.serving.control import SyncStats
from weightsync.serving.hf.loop import EngineLoop
from weightsync.serving.metrics import ServerMetrics
from weightsync.sink import WeightSink, WrappingSink

__all__ = ["AdapterServerSink", "ServerSink"]

log = logging.getLogger(__name__)


class ServerSink(WrappingSink):
    """Wraps an engine's sink so every sync lands while the engine loop is parked: from `begin`
    to the commit, or, when the engine's sink stages syncs, for the commit alone.

    Args:
        inner: the engine's sink (`engine.weight_sink()`).
        loop: the engine loop to pause.
        mode: how to pause for a sync ("wait", "abort" or "keep").
        drain_timeout: seconds to wait for the loop to park before refusing the sync.
        metrics: where sync metrics go.
        model_name: the served model's name, which no adapter may take.
    """

    def __init__(
        self,
        inner: WeightSink,
        loop: EngineLoop,
        *,
        mode: PauseMode,
        drain_timeout: float,
        metrics: ServerMetrics,
        model_name: str = "",
    ) -> None:
        super().__init__(inner)
        self.loop = loop
        self.model_name = model_name
        self.mode = mode
        self.drain_timeout = drain_timeout
        self.metrics = metrics
        self.stats = SyncStats()
        self._dirty = False
        """Whether the served weights are a mix no version names (a sync failed half-written)."""
        self._started = 0.0

    def _park(self, version: int) -> None:
        started = time.perf_counter()
        parked = self.loop.pause("sync", self.mode, self.drain_timeout)
        self.paused_s = time.perf_counter() - started
        if not parked:
            self.loop.resume("sync")
            raise SinkError(
                f"the engine did not finish its requests within {self.drain_timeout} s (sync mode {self.mode!r}); "
                f"version {version} refused"
            )

    def begin(self, plan: Plan, version: int) -> None:
        self.paused_s = 0.0
        self.inner.begin(plan, version)  # a refusal is logged once, by the receiver
        if not self.traits.staged:
            self._park(version)
        self._started = time.perf_counter()
        self.stats = self.stats.next(version, plan.total_bytes, plan.bucket_bytes, self.metrics)

    def commit(self, version: int) -> None:
        if self.traits.staged:
            self._park(version)
        self.inner.commit(version)
        self._dirty = False
        self.stats.committed(time.perf_counter() - self._started, self.metrics)
        self.loop.resume("sync", version)
        log.info("sync of version %d committed: %s", version, moved(self.stats.total_bytes, self.stats.seconds))

    def adapter_sink(self, adapter: Adapter) -> WeightSink:
        check_name(adapter, [self.model_name])
        return AdapterServerSink(self.inner.adapter_sink(adapter), adapter, self.loop, self.drain_timeout)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        try:
            self.inner.abort(version, error, intact=intact)
        finally:
            self.stats.failed(time.perf_counter() - self._started, str(error), self.metrics)
            self._dirty = self._dirty or not intact
            if self._dirty:  # the live weights are not a version we can name
                self.metrics.version.set(-1)
                self.loop.invalidate("sync")
            else:
                self.loop.resume("sync")
            log.warning(
                "sync of version %d failed after %.3f s (%d bytes planned); %s: %s",
                version,
                self.stats.seconds,
                self.stats.total_bytes,
                "the served weights are dirty until the next good sync" if self._dirty else "still serving",
                error,
            )


class AdapterServerSink(WrappingSink):
    """Wraps the engine's sink for one LoRA adapter sync: it lands while the engine serves, and
    the engine loop is parked in keep mode only while the engine takes the adapter (`commit`)."""

    def __init__(self, inner: WeightSink, adapter: Adapter, loop: EngineLoop, drain_timeout: float) -> None:
        super().__init__(inner)
        self.adapter = adapter
        self.loop = loop
        self.drain_timeout = drain_timeout
        self._started = 0.0
        self._bytes = 0

    def begin(self, plan: Plan, version: int) -> None:
        self._started, self._bytes = time.perf_counter(), plan.total_bytes
        self.inner.begin(plan, version)  # a refusal is logged by the receiver

    def commit(self, version: int) -> None:
        started = time.perf_counter()
        try:
            if not self.loop.pause("adapter", "keep", self.drain_timeout):
                raise SinkError(
                    f"the engine did not park within {self.drain_timeout} s; adapter version {version} refused"
                )
            self.paused_s = time.perf_counter() - started
            self.inner.commit(version)
        finally:
            self.loop.resume("adapter")
        log.info(
            "adapter %r version %d committed: %d bytes in %.3f s",
            self.adapter.name,
            version,
            self._bytes,
            time.perf_counter() - self._started,
        )

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        self.inner.abort(version, error, intact=intact)
        log.warning("sync of adapter %r version %d failed; still serving: %s", self.adapter.name, version, error)
