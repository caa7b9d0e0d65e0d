"""The API process's sync control with a stand-in for vLLM's engine: one update window per
version across every worker, who holds the pause, when generation resumes, when a version is
labelled, and what a failed sync leaves behind. No vLLM needed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from weightsync.errors import SinkError
from weightsync.lora import Adapter
from weightsync.messages import SyncTimes
from weightsync.serving.control import SyncControl
from weightsync.serving.metrics import ServerMetrics
from weightsync.workers.events import (
    AdapterFailed,
    AdapterLanded,
    PushArrived,
    ReceiverChanged,
    VersionFailed,
    VersionLanded,
)


class Engine:
    """What SyncControl calls on vLLM, recorded. `drained` gates a "wait" pause; `landed` ends
    vLLM's update call (every worker's stream ended)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.drained = asyncio.Event()
        self.drained.set()
        self.landed = asyncio.Event()
        self.landed.set()
        self.errored = False
        self.start_error: Exception | None = None

    name = "vLLM"

    def failure(self) -> str:
        return "vLLM's engine died; restart the server" if self.errored else ""

    async def pause_generation(self, *, mode: str) -> None:
        self.calls.append(("pause", mode))
        if mode == "wait":
            await self.drained.wait()

    async def resume_generation(self) -> None:
        self.calls.append(("resume", None))

    async def start_weight_update(self) -> None:
        self.calls.append(("start", None))
        if self.start_error is not None:
            raise self.start_error

    async def update_weights(self, version: int) -> None:
        self.calls.append(("update", version))
        await self.landed.wait()

    async def finish_weight_update(self, version: int | None) -> None:
        self.calls.append(("finish", version))

    async def serve_lora(self, name: str, lora_id: int, path: str) -> None:
        self.calls.append(("serve_lora", (name, lora_id)))

    async def remove_lora(self, lora_id: int) -> None:
        self.calls.append(("remove_lora", lora_id))


def control(
    engine: Engine, mode: str = "wait", workers: int = 1, lora_versions: int = 0, **timeouts: float
) -> SyncControl:
    return SyncControl(
        engine,  # type: ignore[arg-type]
        workers=workers,
        mode=mode,  # type: ignore[arg-type]
        drain_timeout=timeouts.get("drain_timeout", 5.0),
        sync_timeout=timeouts.get("sync_timeout", 5.0),
        metrics=ServerMetrics(),
        version=None,
        lora_versions=lora_versions,
    )


async def sync_on(
    sync: SyncControl, version: int, *outcomes: VersionLanded | VersionFailed
) -> list[BaseException | None]:
    """Every worker rings PushArrived (opening the window), then its outcome, as workers do: at once.
    Returns what each outcome's ring got (None: ok)."""
    await asyncio.gather(*(sync.on_event(PushArrived(version=version, rank=o.rank, park=True)) for o in outcomes))
    results = await asyncio.gather(*(sync.on_event(o) for o in outcomes), return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in results]


def test_one_window_for_every_worker_labels_the_version_once_all_landed_it() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, mode="keep", workers=2)
        assert sync.health().state == "waiting for weights"
        assert await sync_on(sync, 1, VersionLanded(version=1, rank=0), VersionLanded(version=1, rank=1)) == [
            None,
            None,
        ]
        assert engine.calls == [("pause", "keep"), ("start", None), ("update", 1), ("finish", 1), ("resume", None)]
        assert sync.version == 1 and sync.health().ok and sync.stats.to_json()["num_committed"] == 1
        assert await sync.wait_servable(0.01)

    asyncio.run(scenario())


def test_a_users_pause_outlasts_a_sync() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine)
        assert await sync.pause("user", "keep", 5.0)
        await sync_on(sync, 1, VersionLanded(version=1))
        assert ("resume", None) not in engine.calls and sync.paused_by == {"user": "keep"}
        assert engine.calls.count(("pause", "keep")) == 1  # the sync did not re-pause in another mode
        await sync.resume("user")
        assert engine.calls[-1] == ("resume", None)

    asyncio.run(scenario())


def test_a_sync_that_cannot_park_is_refused_and_opens_nothing() -> None:
    async def scenario() -> None:
        engine = Engine()
        engine.drained.clear()  # requests that never finish
        sync = control(engine, mode="wait", drain_timeout=0.05)
        with pytest.raises(SinkError, match="did not pause within 0.05 s"):
            await sync.on_event(PushArrived(version=1, park=True))
        await sync.on_event(VersionFailed(version=1, intact=True, error="refused"))
        assert sync.paused_by == {} and engine.calls[-1] == ("resume", None)
        assert ("start", None) not in engine.calls and sync.state() != "dirty"
        engine.drained.set()

    asyncio.run(scenario())


def test_one_worker_failing_refuses_the_others_commit_and_serves_nothing_until_a_good_sync() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, mode="keep", workers=2)
        await sync_on(sync, 1, VersionLanded(version=1, rank=0), VersionLanded(version=1, rank=1))
        got = await sync_on(
            sync, 2, VersionLanded(version=2, rank=0), VersionFailed(version=2, rank=1, intact=True, error="killed")
        )
        assert isinstance(got[0], SinkError) and "worker 1: killed" in str(got[0]) and got[1] is None
        now = sync.health()
        assert (now.ok, now.state, sync.version) == (False, "dirty", None) and "killed" in now.reason
        assert ("finish", None) in engine.calls and ("pause", "abort") in engine.calls
        assert ("resume", None) not in engine.calls[-3:] and sync.paused_by == {"dirty": "abort"}  # still paused: dirty
        assert not await sync.wait_servable(0.01)
        assert await sync_on(sync, 3, VersionLanded(version=3, rank=0), VersionLanded(version=3, rank=1)) == [
            None,
            None,
        ]
        assert sync.health().ok and sync.version == 3 and sync.paused_by == {}

    asyncio.run(scenario())


def test_workers_that_all_failed_before_landing_anything_keep_the_previous_version() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, workers=2)
        await sync_on(sync, 1, VersionLanded(version=1, rank=0), VersionLanded(version=1, rank=1))
        failed = [VersionFailed(version=2, rank=rank, intact=True, error="checksum") for rank in (0, 1)]
        assert await sync_on(sync, 2, *failed) == [None, None]
        assert sync.health().ok and sync.version == 1 and sync.stats.to_json()["num_failed"] == 1
        assert engine.calls[-2:] == [("finish", None), ("resume", None)]

    asyncio.run(scenario())


def test_a_staged_transfer_that_fails_before_its_window_pauses_nothing() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, workers=2)
        await sync_on(sync, 1, VersionLanded(version=1, rank=0), VersionLanded(version=1, rank=1))
        calls = len(engine.calls)
        for rank in (0, 1):
            await sync.on_event(PushArrived(version=2, rank=rank, park=False))
        for rank in (0, 1):
            await sync.on_event(VersionFailed(version=2, rank=rank, intact=True, error="sender died"))
        assert engine.calls[calls:] == [] and sync.version == 1 and sync.stats.to_json()["num_failed"] == 1

    asyncio.run(scenario())


def test_a_worker_that_never_answers_fails_the_sync_within_the_timeout() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, workers=2, sync_timeout=0.2)
        got = await sync_on(sync, 1, VersionLanded(version=1, rank=0))
        assert isinstance(got[0], SinkError) and "no outcome from worker(s) [1]" in str(got[0])
        assert sync.state() == "dirty"  # worker 0 landed it, worker 1 is unknown

    asyncio.run(scenario())


def test_an_engine_that_dies_during_the_update_fails_the_sync() -> None:
    async def scenario() -> None:
        engine = Engine()
        engine.landed.clear()  # vLLM's update call never returns: a worker process died
        sync = control(engine, workers=2, sync_timeout=0.2)
        await sync.on_event(PushArrived(version=1, rank=0, park=True))
        engine.errored = True
        got = await asyncio.gather(sync.on_event(VersionLanded(version=1, rank=0)), return_exceptions=True)
        assert isinstance(got[0], SinkError) and "engine died" in str(got[0])
        assert sync.health().state == "failed" and sync.state() == "dirty"

    asyncio.run(scenario())


def test_a_second_version_waits_for_none_while_one_is_open() -> None:
    async def scenario() -> None:
        engine = Engine()
        engine.landed.clear()
        sync = control(engine, workers=1, sync_timeout=0.2)
        await sync.on_event(PushArrived(version=1, park=True))
        with pytest.raises(SinkError, match="the sync of version 1 is in progress"):
            await sync.on_event(PushArrived(version=2, park=True))
        engine.landed.set()
        await sync.on_event(VersionLanded(version=1))
        assert sync.version == 1

    asyncio.run(scenario())


def test_each_workers_status_is_kept_and_counted_once() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, workers=2)
        engine.errored = True
        assert sync.health().state == "failed"
        engine.errored = False
        times = SyncTimes(total_s=0.5, transfer_s=0.1, landing_s=0.2, load_s=0.2)
        for rank in (0, 1):
            await sync.on_event(
                ReceiverChanged(rank=rank, state="syncing", content_digest="ab", times=times, mode="delta")
            )
        assert sync.receiver == ReceiverChanged(rank=0, state="syncing", content_digest="ab", times=times, mode="delta")
        assert sync.health().state == "syncing" and sync.state() == "syncing"
        assert 'weightsync_sync_modes_total{mode="delta"} 1.0' in sync.metrics.render().decode()

    asyncio.run(scenario())


def test_a_start_that_fails_on_some_worker_is_finished_and_serves_nothing() -> None:
    async def scenario() -> None:
        engine = Engine()
        sync = control(engine, workers=2)
        await sync_on(sync, 1, VersionLanded(version=1, rank=0), VersionLanded(version=1, rank=1))
        engine.start_error = RuntimeError("worker 1: reload could not begin")
        with pytest.raises(RuntimeError, match="could not begin"):
            await sync.on_event(PushArrived(version=2, rank=0, park=True))
        for rank in (0, 1):
            await sync.on_event(VersionFailed(version=2, rank=rank, intact=True, error="refused"))
        assert engine.calls.count(("finish", None)) == 1  # the workers whose reload began end it
        assert sync.state() == "dirty" and sync.version is None  # a half-begun reload is no version

    asyncio.run(scenario())


# --- LoRA adapters: served once every worker holds them ----------------------------------------

ADAPTER = Adapter("policy", 4, 8.0, ("q_proj",))


def landed(version: int, rank: int, lora_id: int) -> AdapterLanded:
    path = f"weightsync://policy/{version}/{lora_id}"
    return AdapterLanded(adapter=ADAPTER, version=version, rank=rank, lora_id=lora_id, path=path)


async def _test_an_adapter_is_served_once_every_worker_holds_it_and_old_versions_retire() -> None:
    engine = Engine()
    sync = control(engine, workers=2, lora_versions=2)
    for version in (1, 2, 3):
        replies = await asyncio.gather(*(sync.on_event(landed(version, rank, 100 + version)) for rank in (0, 1)))
        assert all(reply is not None and reply.ok for reply in replies)
    served = [args for call, args in engine.calls if call == "serve_lora"]
    assert served == [("policy", 101), ("policy", 102), ("policy", 103)]  # once per version, not per worker
    assert [args for call, args in engine.calls if call == "remove_lora"] == [101]
    assert [v.version for v in sync.adapters["policy"].versions] == [2, 3]
    reply = await asyncio.gather(*(sync.on_event(landed(4, rank, 104)) for rank in (0, 1)))
    assert 101 in reply[0].retired  # the workers drop it from memory


async def _test_one_worker_failing_refuses_the_adapter_on_every_worker() -> None:
    engine = Engine()
    sync = control(engine, workers=2, lora_versions=2)
    failed = AdapterFailed(name="policy", version=1, rank=1, error="the sender died")
    results = await asyncio.gather(sync.on_event(landed(1, 0, 101)), sync.on_event(failed), return_exceptions=True)
    assert isinstance(results[0], SinkError) and "worker 1: the sender died" in str(results[0])
    assert "policy" not in sync.adapters and not [c for c, _ in engine.calls if c == "serve_lora"]


async def _test_a_server_without_lora_refuses_adapters() -> None:
    sync = control(Engine(), workers=1)
    with pytest.raises(SinkError, match="--max-lora-rank"):
        await sync.on_event(landed(1, 0, 101))


def test_an_adapter_is_served_once_every_worker_holds_it_and_old_versions_retire() -> None:
    asyncio.run(_test_an_adapter_is_served_once_every_worker_holds_it_and_old_versions_retire())


def test_one_worker_failing_refuses_the_adapter_on_every_worker() -> None:
    asyncio.run(_test_one_worker_failing_refuses_the_adapter_on_every_worker())


def test_a_server_without_lora_refuses_adapters() -> None:
    asyncio.run(_test_a_server_without_lora_refuses_adapters())
