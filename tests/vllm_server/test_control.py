"""The API process's sync control with a stand-in for AsyncLLM: who holds the pause, when
generation resumes, what a failed sync leaves behind. No vLLM needed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from weightsync.errors import SinkError
from weightsync.server.metrics import ServerMetrics
from weightsync.types import SyncTimes
from weightsync.vllm_server.control import SyncControl
from weightsync.vllm_server.events import Abort, Begin, Commit, Status


class Engine:
    """What SyncControl calls on AsyncLLM, recorded; `drained` gates a "wait" pause."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.drained = asyncio.Event()
        self.drained.set()

    async def pause_generation(self, *, mode: str) -> None:
        self.calls.append(("pause", mode))
        if mode == "wait":
            await self.drained.wait()

    async def resume_generation(self) -> None:
        self.calls.append(("resume", None))

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("version", version))


def control(engine: Engine, mode: str = "wait", drain_timeout: float = 5.0) -> SyncControl:
    return SyncControl(engine, mode=mode, drain_timeout=drain_timeout, metrics=ServerMetrics(), version=None)  # type: ignore[arg-type]


def test_a_sync_pauses_lands_labels_and_resumes() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, mode="keep")
        assert sync.health(False).state == "waiting for weights"
        await sync.on_event(Begin(version=1, bucket_bytes=4, park=True, total_bytes=10))
        assert sync.paused_by == ["sync"]
        await sync.on_event(Commit(version=1))
        assert engine.calls == [("pause", "keep"), ("version", "1"), ("resume", None)]
        assert sync.version == 1 and sync.health(False).ok and sync.stats.to_json()["num_committed"] == 1
        assert await sync.wait_servable(0.01)

    asyncio.run(scenario())


def test_a_users_pause_outlasts_a_sync() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine)
        assert await sync.pause("user", "keep", 5.0)
        await sync.on_event(Begin(version=1, park=True))
        await sync.on_event(Commit(version=1))
        assert ("resume", None) not in engine.calls and sync.paused_by == ["user"]
        assert engine.calls.count(("pause", "keep")) == 1  # the sync did not re-pause in another mode
        await sync.resume("user")
        assert engine.calls[-1] == ("resume", None)

    asyncio.run(scenario())


def test_a_sync_that_cannot_park_is_refused_and_pauses_nothing() -> None:
    async def scenario() -> None:
        engine = Engine()
        engine.drained.clear()  # requests that never finish
        sync = control(engine, mode="wait", drain_timeout=0.05)
        with pytest.raises(SinkError, match="did not pause within 0.05 s"):
            await sync.on_event(Begin(version=1, park=True))
        assert sync.paused_by == [] and engine.calls[-1] == ("resume", None)
        engine.drained.set()

    asyncio.run(scenario())


def test_a_dirty_failure_stops_serving_until_the_next_good_sync() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, mode="keep")
        await sync.on_event(Begin(version=1, park=True))
        await sync.on_event(Commit(version=1))
        await sync.on_event(Begin(version=2, park=True))
        await sync.on_event(Abort(version=2, intact=False, error="sender died"))
        now = sync.health(False)
        assert (now.ok, now.state, sync.version) == (False, "dirty", None) and "sender died" in now.reason
        assert ("pause", "abort") in engine.calls and engine.calls[-1] != ("resume", None)
        assert not await sync.wait_servable(0.01)
        await sync.on_event(Begin(version=3, park=True))
        await sync.on_event(Commit(version=3))
        assert sync.health(False).ok and sync.version == 3 and engine.calls[-1] == ("resume", None)

    asyncio.run(scenario())


def test_an_intact_failure_keeps_serving_the_previous_version() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine)
        await sync.on_event(Begin(version=1, park=True))
        await sync.on_event(Commit(version=1))
        await sync.on_event(Begin(version=2, park=False))  # staged: no pause yet
        await sync.on_event(Abort(version=2, intact=True, error="checksum"))
        assert sync.health(False).ok and sync.version == 1 and sync.stats.to_json()["num_failed"] == 1

    asyncio.run(scenario())


def test_a_dead_engine_fails_health_and_a_status_event_is_kept_whole() -> None:
    async def scenario() -> None:
        sync = control(Engine())
        assert sync.health(True).state == "failed"
        times = SyncTimes(total_s=0.5, transfer_s=0.1, landing_s=0.2, load_s=0.2)
        await sync.on_event(Status(state="syncing", content_digest="ab", times=times, mode="delta"))
        assert sync.receiver == Status(state="syncing", content_digest="ab", times=times, mode="delta")
        assert sync.health(False).state == "syncing" and sync.state() == "syncing"
        assert 'weightsync_sync_modes_total{mode="delta"} 1.0' in sync.metrics.render().decode()

    asyncio.run(scenario())
