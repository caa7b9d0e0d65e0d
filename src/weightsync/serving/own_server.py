"""An engine's own server with weightsync's parts on top: what the vLLM and SGLang adapters share.

Both run the engine's own app in this process and its workers in processes of the engine's
own; each adapter supplies its launch (arguments, build, warm-up, app) and a `WorkerEngine`
(the control's `Engine`, plus how a start message reaches its workers), and serves it with
`foreground.serve_engine`. The rest is here, once:

    run(config, engine, app, port, ...)           the sync control, the doorbell, every worker's
                                                  receiver started, the routes and the face
                                                  around the engine's app, its lifespan, until
                                                  the port stops
    start_receivers(engine, config, bell)         one `Start` to every worker; their addresses
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from weightsync.errors import ResourceError
from weightsync.serving.config import AUTO_VERSION, Health, ServeConfig
from weightsync.serving.control import Engine, SyncControl
from weightsync.serving.foreground import Port, Ready
from weightsync.serving.http import ASGIApp, Face, add_routes
from weightsync.serving.labels import WeightVersionMiddleware
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.stats import Served
from weightsync.workers.doorbell import Doorbell
from weightsync.workers.rendezvous import Rendezvous, WorkerAddress
from weightsync.workers.start import Start

__all__ = ["WorkerEngine", "run", "start_receivers"]

RPC_TIMEOUT_S = 120.0
"""Seconds starting the workers' receivers may take."""


class WorkerEngine(Engine, Protocol):
    """An engine whose workers run weightsync's receivers in processes of its own; `num_workers`:
    how many each sync reaches (every tensor-, pipeline- and data-parallel rank)."""

    @property
    def num_workers(self) -> int: ...

    async def label(self, version: int) -> None:
        """Name the weights served `version` from now on (the checkpoint loaded at start-up)."""

    async def start_workers(self, start: Start) -> None:
        """Hand `start` to every worker (the engine's own call); returns once each has run it."""

    async def stop_workers(self) -> None:
        """Close every worker's receiver, as the server stops (bounded; nothing raises)."""


async def run(
    config: ServeConfig,
    engine: WorkerEngine,
    app: Any,
    port: Port,
    announce: Callable[[Ready], None],
    *,
    metrics: ServerMetrics,
    route: bool = True,
    busy: Callable[[int], bool] = lambda lora_id: False,
    outer: Callable[[ASGIApp], ASGIApp] = lambda face: face,
) -> None:
    """Serve the engine's `app` on `port` until the port stops, under one `SyncControl`: the
    doorbell every worker rings, their receivers started, weightsync's routes added (`route`:
    /metrics too, from `metrics`; else the engine's own /metrics serves them), the face around
    the app (inside `outer`), the app's lifespan; `announce(Ready)` once it serves. `busy`: the
    control's (whether a request runs on a LoRA adapter version).

    Raises:
        ResourceError: not every worker's receiver started.
    """
    initial = AUTO_VERSION if config.load_format == "auto" else None
    if initial is not None:
        await engine.label(initial)
    control = SyncControl(
        engine,
        workers=engine.num_workers,
        mode=config.sync_mode,
        drain_timeout=config.drain_timeout,
        sync_timeout=config.receiver.timeout,
        metrics=metrics,
        version=initial,
        lora_versions=config.lora_versions if config.max_lora_rank else 0,
        busy=busy,
    )
    bell = Doorbell(control.on_event, timeout=config.receiver.timeout)
    await bell.start()
    try:
        workers = await start_receivers(engine, config, bell.path)
        addresses = tuple(worker.address for worker in workers)
        served = Served(
            engine=config.engine,
            model=config.model_name,
            transport=config.transport,
            addresses=addresses,
            weight_bytes=workers[0].weight_bytes,
        )
        add_routes(app, control, served, metrics=metrics.render if route else None)
        # Wrapped around the engine's app rather than added to it: its app built its middleware
        # stack already (vLLM's build_app), and FastAPI refuses additions after that.
        front = outer(Face(WeightVersionMiddleware(app, control, config.model_name), control, config))
        try:
            async with app.router.lifespan_context(app):
                port.front.app = front
                announce(Ready(addresses))
                await port.serving
        finally:
            port.front.app = None
            port.front.health = Health(False, "failed", "the server is stopping")
            control.close()  # a sync in progress ends here: the engine's workers go next
            await engine.stop_workers()
    finally:
        await bell.close()


async def start_receivers(engine: WorkerEngine, config: ServeConfig, bell: str) -> list[WorkerAddress]:
    """Start weightsync's receiver in every worker (one `Start`, naming the doorbell `bell`) and
    return the workers' addresses, in rank order; they announce them in a rendezvous store
    hosted for the call.

    Raises:
        ResourceError: a worker's receiver did not start, or not every worker announced one.
    """
    with Rendezvous("127.0.0.1", RPC_TIMEOUT_S) as rendezvous:
        start = Start(
            rendezvous=rendezvous.where,
            session=rendezvous.session,
            transport=config.transport,
            receiver=config.receiver.without_token(),
            bell=bell,
            staged=config.staged,
            drain_timeout=config.drain_timeout,
            lora_versions=config.lora_versions if config.max_lora_rank else 0,
        )
        try:
            await asyncio.wait_for(engine.start_workers(start), RPC_TIMEOUT_S)
            workers = sorted(rendezvous.collect(), key=lambda worker: worker.rank)
        except Exception as exc:
            raise ResourceError(f"weightsync's receivers did not start in {engine.name}'s workers: {exc}") from exc
    if len(workers) != engine.num_workers:
        raise ResourceError(
            f"{len(workers)} of {engine.name}'s {engine.num_workers} workers started a receiver (the workers' log says why)"
        )
    return workers
