"""`weightsync serve --engine vllm`: vLLM's own OpenAI server, with weightsync's parts on top.

How it is put together, and why this way (docs/server.md has the longer account):

1. vLLM's arguments are parsed by vLLM's own `make_arg_parser` (engine.py), from weightsync's
   flags plus anything given with --engine-args: every `vllm serve` option works, with vLLM's
   defaults.
2. The engine is vLLM's `AsyncLLM` (engine core and worker in vLLM's own processes), built from
   those arguments with the same public calls vLLM's `build_async_engine_client_from_engine_args`
   makes, on a thread: that build blocks for 20-30 s, and the port answers 503 "loading engine"
   meanwhile instead of hanging.
3. The app is vLLM's `build_app(...)`, its state set by vLLM's `init_app_state(...)`: every
   route, handler, chat template, tool parser and sampling parameter is vLLM's own code.
4. Every worker runs weightsync's receiver as vLLM's own weight-transfer backend `weightsync`
   (integrations/vllm), started with vLLM's `init_weight_transfer_engine`; the workers tell
   this process their addresses through a rendezvous store it hosts for that call, and ring its
   doorbell as a push reaches them: this process then runs vLLM's update window on every worker
   (control.py), and syncs land through vLLM's layerwise reload.
5. weightsync adds its routes and one middleware (http.py): /health, /weight_info, /pause,
   /resume, the gate, bearer auth, weight versions on responses; its metrics join vLLM's
   registry, so /metrics shows both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from weightsync.errors import ResourceError
from weightsync.integrations.vllm.internals import serve_lora
from weightsync.serving.config import AUTO_VERSION, Health, PauseMode, ServeConfig
from weightsync.serving.control import Served, SyncControl
from weightsync.serving.foreground import Port, Ready, serve_engine
from weightsync.serving.http import Face, add_routes
from weightsync.serving.labels import Versioned
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.tokenizer import NO_CHAT_TEMPLATE, load_tokenizer
from weightsync.serving.vllm.launch import build_async_llm, vllm_namespace, warm_up
from weightsync.serving.vllm.launch import preload as preload_vllm
from weightsync.serving.vllm.versions import LoraUse, VersionedEngine
from weightsync.workers.doorbell import Doorbell
from weightsync.workers.rendezvous import Rendezvous, WorkerAddress

__all__ = ["check", "preload", "serve"]

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 120.0
"""Seconds a start-up or shut-down call into vLLM's workers may take."""


STOP_RPC_S = 1.0
"""Seconds the workers get to close their receivers at a stop: a worker busy in a sync answers
only once the sync ends (up to its timeout), and vLLM's shutdown ends the workers anyway."""


class _MetricsBridge:
    """weightsync's registry as one collector in vLLM's: /metrics serves both."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.registry = metrics.registry

    def collect(self) -> Iterator[Any]:
        yield from self.registry.collect()


class _Engine:
    """vLLM's `AsyncLLM` as the sync control calls it (`control.Engine`); `models`: vLLM's
    `OpenAIServingModels`, which routes a request's model name to a LoRA adapter."""

    name = "vLLM"

    def __init__(self, engine: Any, models: Any) -> None:
        self.engine = engine
        self.models = models

    @property
    def errored(self) -> bool:
        return bool(self.engine.errored)

    def failure(self) -> str:
        return "vLLM's engine died; restart the server" if self.errored else ""

    async def pause_generation(self, *, mode: PauseMode) -> None:
        await self.engine.pause_generation(mode=mode)

    async def resume_generation(self) -> None:
        await self.engine.resume_generation()

    async def start_weight_update(self) -> None:
        await self.engine.start_weight_update()

    async def update_weights(self, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))

    async def finish_weight_update(self, version: int | None) -> None:
        await self.engine.finish_weight_update(None if version is None else str(version))

    async def serve_lora(self, name: str, lora_id: int, path: str) -> None:
        from vllm.lora.request import LoRARequest

        # vLLM's own add_lora: every worker loads it (from memory, internals.py) and checks it
        await self.engine.add_lora(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path))
        serve_lora(self.models, name, lora_id, path)

    async def remove_lora(self, lora_id: int) -> None:
        await self.engine.remove_lora(lora_id)


async def _start_receivers(engine: Any, config: ServeConfig, bell: str) -> list[WorkerAddress]:
    """Start weightsync's receiver in every vLLM worker (vLLM's `init_weight_transfer_engine`)
    and return the workers' addresses, in rank order.

    Raises:
        ResourceError: a worker's receiver did not start, or not every worker announced one.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    from weightsync.integrations.vllm.worker import WeightsyncInitInfo

    with Rendezvous("127.0.0.1", RPC_TIMEOUT_S) as rendezvous:
        info = WeightsyncInitInfo(
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
            request = WeightTransferInitRequest(init_info=dataclasses.asdict(info))
            await asyncio.wait_for(engine.init_weight_transfer_engine(request), RPC_TIMEOUT_S)
            workers = sorted(rendezvous.collect(), key=lambda worker: worker.rank)
        except Exception as exc:
            raise ResourceError(f"weightsync's receivers did not start in vLLM's workers: {exc}") from exc
    expected = engine.vllm_config.parallel_config.world_size
    if len(workers) != expected:
        raise ResourceError(f"{len(workers)} of vLLM's {expected} workers started a receiver")
    return workers


def check(config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
    """Raises ConfigError when vLLM's own parser refuses the arguments."""
    vllm_namespace(config, extra_args)


def preload(config: ServeConfig) -> None:
    """Imports and a heap freeze before the port listens (launch.py)."""
    preload_vllm(config.model)


async def serve(
    config: ServeConfig,
    sock: socket.socket,
    *,
    extra_args: Sequence[str] = (),
    announce: Callable[[Ready], None] = lambda ready: None,
    log_level: str = "info",
    stop: asyncio.Event | None = None,
    note: Callable[[], None] = lambda: None,
    shutdown_timeout: float | None = None,
) -> list[int]:
    """Serve until SIGTERM/SIGINT (or `stop` is set); `announce(ready)` once ready (every
    worker's receiver). Returns the signals that stopped it (none: `stop`).
    `note()` is called while vLLM's processes start, once they serve, and before they stop: the
    caller records what they made (`weightsync.serving.footprint.Footprint.note`). vLLM's own
    shutdown gets `shutdown_timeout` seconds (None: as long as it takes); a caller that bounds
    it ends what is left of vLLM's processes once `serve` returns.

    Raises:
        ConfigError: vLLM refused the arguments.
        ResourceError: the engine or the receiver could not start.
    """
    args = vllm_namespace(config, extra_args)
    if config.chat_template is None and not args.chat_template:
        tokenizer, _ = load_tokenizer(config.model)
        if tokenizer is not None and not tokenizer.chat_template:
            log.warning(NO_CHAT_TEMPLATE, config.model)
    if config.auth_token is not None:  # vLLM's workers inherit it: their receivers require it
        os.environ["WEIGHTSYNC_AUTH_TOKEN"] = config.auth_token
    build = functools.partial(build_async_llm, args)

    async def run(engine: Any, port: Port, ready: Callable[[Ready], None]) -> None:
        await _serve_engine(config, args, engine, port, ready)

    loading = f"loading the vllm engine for {config.model}"
    return await serve_engine(
        "vLLM",
        build,
        run,
        sock,
        loading=loading,
        announce=announce,
        log_level=log_level,
        stop=stop,
        note=note,
        shutdown_timeout=shutdown_timeout,
    )


async def _serve_engine(
    config: ServeConfig,
    args: argparse.Namespace,
    engine: Any,
    port: Port,
    announce: Callable[[Ready], None],
) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    await warm_up(engine, config.model)
    await engine.reset_mm_cache()
    supported = await engine.get_supported_tasks()
    app = build_app(args, supported, engine.model_config)
    loras = LoraUse()
    await init_app_state(VersionedEngine(engine, loras), app.state, args, supported)

    metrics = ServerMetrics()
    initial = AUTO_VERSION if config.load_format == "auto" else None
    if initial is not None:
        await engine.update_weight_version(str(initial))
    control = SyncControl(
        _Engine(engine, app.state.openai_serving_models),
        workers=engine.vllm_config.parallel_config.world_size,
        mode=config.sync_mode,
        drain_timeout=config.drain_timeout,
        sync_timeout=config.receiver.timeout,
        metrics=metrics,
        version=initial,
        lora_versions=config.lora_versions if config.max_lora_rank else 0,
        busy=loras.busy,
    )
    bell = Doorbell(control.on_event, timeout=config.receiver.timeout)
    await bell.start()
    bridge = _MetricsBridge(metrics)
    registry = get_prometheus_registry()
    registry.register(bridge)
    try:
        workers = await _start_receivers(engine, config, bell.path)
        addresses = [worker.address for worker in workers]

        served = Served(
            engine="vllm",
            model=config.model_name,
            transport=config.transport,
            addresses=tuple(addresses),
            weight_bytes=workers[0].weight_bytes,
        )
        add_routes(app, control, served, metrics=None)  # vLLM's /metrics serves ours too (the bridge)
        # Wrapped around vLLM's app rather than added to it: vLLM's build_app already built its
        # middleware stack, and FastAPI refuses additions after that.
        outer = Face.of(Versioned(app, control), control, config)
        try:
            async with app.router.lifespan_context(app):
                port.front.app = outer
                announce(Ready(tuple(addresses)))
                await port.serving
        finally:
            port.front.app = None
            port.front.health = Health(False, "failed", "the server is stopping")
            control.close()  # a sync in progress ends here: vLLM's engine goes next
            with contextlib.suppress(Exception):
                await asyncio.wait_for(engine.shutdown_weight_transfer_engine(), STOP_RPC_S)
    finally:
        registry.unregister(bridge)
        await bell.close()
