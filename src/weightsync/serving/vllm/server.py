"""`weightsync serve --engine vllm`: vLLM's own OpenAI server, with weightsync's parts on top.

How it is put together, and why this way (docs/server.md has the longer account; what this
adapter shares with SGLang's is own_server.py):

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
import functools
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from weightsync.integrations.vllm.internals import serve_lora
from weightsync.serving import own_server
from weightsync.serving.config import PauseMode, ServeConfig
from weightsync.serving.foreground import Port, Ready, ServeOptions, serve_engine
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.tokenizer import NO_CHAT_TEMPLATE, load_tokenizer
from weightsync.serving.vllm.launch import build_async_llm, vllm_namespace, warm_up
from weightsync.serving.vllm.launch import preload as preload_vllm
from weightsync.serving.vllm.versions import LoraUse, VersionedEngine
from weightsync.workers.start import Start

__all__ = ["check", "preload", "serve"]

log = logging.getLogger(__name__)

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
    """vLLM's `AsyncLLM` as the server calls it (`own_server.WorkerEngine`); `models`: vLLM's
    `OpenAIServingModels`, which routes a request's model name to a LoRA adapter."""

    name = "vLLM"

    def __init__(self, engine: Any, models: Any) -> None:
        self.engine = engine
        self.models = models
        self.num_workers = int(engine.vllm_config.parallel_config.world_size)

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

    async def label(self, version: int) -> None:
        await self.engine.update_weight_version(str(version))

    async def start_workers(self, start: Start) -> None:
        """Every worker starts its receiver (vLLM's `init_weight_transfer_engine`)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from weightsync.integrations.vllm.worker import as_init_info

        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=as_init_info(start)))

    async def stop_workers(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.engine.shutdown_weight_transfer_engine(), STOP_RPC_S)


def check(config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
    """Raises ConfigError when vLLM's own parser refuses the arguments."""
    vllm_namespace(config, extra_args)


def preload(config: ServeConfig) -> None:
    """Imports and a heap freeze before the port listens (launch.py)."""
    preload_vllm(config.model)


async def serve(config: ServeConfig, sock: socket.socket, options: ServeOptions) -> list[int]:
    """The adapter's `serve` (engines.EngineAdapter): vLLM's own server, ready once every
    worker's receiver is. A caller that bounds `shutdown_timeout` ends what is left of vLLM's
    processes once `serve` returns."""
    args = vllm_namespace(config, options.extra_args)
    if config.chat_template is None and not args.chat_template:
        tokenizer, _ = load_tokenizer(config.model)
        if tokenizer is not None and not tokenizer.chat_template:
            log.warning(NO_CHAT_TEMPLATE, config.model)
    build = functools.partial(build_async_llm, args)
    return await serve_engine("vLLM", config, sock, build, functools.partial(_serve_engine, config, args), options)


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
    bridge = _MetricsBridge(metrics)
    registry = get_prometheus_registry()
    registry.register(bridge)
    try:
        vllm = _Engine(engine, app.state.openai_serving_models)
        # vLLM's /metrics serves ours too (the bridge)
        await own_server.run(config, vllm, app, port, announce, metrics=metrics, route=False, busy=loras.busy)
    finally:
        registry.unregister(bridge)
