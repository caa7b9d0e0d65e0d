"""The transformers engine's adapter: one rollout server's parts, built from one config.

engine    a transformers model stepped token by token (engine.py), on one thread (loop.py)
control   the server's sync control (serving/control.py), on an event loop of its own thread;
          `LoopEngine` is how it drives the engine loop
receiver  a `WeightReceiver` whose sink (`ControlledSink`) rings the control in process and
          lands syncs straight into the engine's live tensors, so the process holds one copy
          of the model
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

from weightsync.digest import source_digest
from weightsync.errors import ConfigError
from weightsync.lora import Adapter
from weightsync.messages import Plan
from weightsync.receiver import WeightReceiver
from weightsync.serving.config import AUTO_VERSION, Health, PauseMode, ServeConfig
from weightsync.serving.control import SyncControl
from weightsync.serving.engines import require_engine
from weightsync.serving.hf.base import SamplingParams, StepEngine
from weightsync.serving.hf.loop import EngineLoop
from weightsync.serving.hf.lora import LoraServing
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.stats import Served
from weightsync.serving.tokenizer import NO_CHAT_TEMPLATE, load_tokenizer
from weightsync.workers.sink import ControlledSink, LocalBell

__all__ = ["FAILED_STEPS_UNHEALTHY", "HeldAdapters", "LoopEngine", "RolloutServer", "build_engine", "warm_up"]

T = TypeVar("T")

log = logging.getLogger(__name__)

FAILED_STEPS_UNHEALTHY = 3
"""Engine steps failing in a row that make /health answer 503 ("failed"), until one succeeds."""


def build_engine(config: ServeConfig) -> StepEngine:
    require_engine(config.engine)
    from weightsync.serving.hf.engine import HFEngine

    return HFEngine(
        config.model,
        load_format=config.load_format,
        staged=config.staged,
        max_lora_rank=config.max_lora_rank,
        lora_versions=config.lora_versions,
    )


class LoopEngine:
    """The transformers engine loop as the sync control drives it (`control.Engine`). Syncs land
    on the receiver's thread while the loop is parked, so the update window's start and update
    calls have nothing to do; a commit labels the loop's tokens with the new version."""

    name = "transformers"
    errored = False

    def __init__(self, loop: EngineLoop, adapters: HeldAdapters | None, timeout: float) -> None:
        self.loop = loop
        self.adapters = adapters
        self.timeout = timeout

    def failure(self) -> str:
        if self.loop.failed_steps < FAILED_STEPS_UNHEALTHY:
            return ""
        return f"the engine failed its last {self.loop.failed_steps} steps: {self.loop.last_failure}"

    async def pause_generation(self, *, mode: PauseMode) -> None:
        ticket = self.loop.pause(mode)
        await asyncio.to_thread(self.loop.wait_parked, ticket)

    async def resume_generation(self) -> None:
        self.loop.resume()

    async def start_weight_update(self) -> None:
        pass

    async def update_weights(self, version: int) -> None:
        pass

    async def finish_weight_update(self, version: int | None) -> None:
        if version is not None:
            self.loop.set_version(version)

    async def serve_lora(self, name: str, lora_id: int, path: str) -> None:
        if self.adapters is None:
            raise ConfigError("this server serves no LoRA adapters (start it with --max-lora-rank N)")
        install = self.adapters.install_on_loop(lora_id)
        await asyncio.to_thread(self.loop.call, install, self.timeout)

    async def remove_lora(self, lora_id: int) -> None:
        pass  # PEFT's slots are freed by the engine (hf/lora.py) once no request runs on them


class HeldAdapters:
    """The LoRA adapter versions this server landed, held until the control has the engine take
    them (`workers.sink.LoraStore`).

    Args:
        lora: the engine's PEFT adapters.
        model_names: the names the base model is served under.
    """

    def __init__(self, lora: LoraServing, model_names: tuple[str, ...]) -> None:
        self.lora = lora
        self.model_names = model_names
        self._ids = itertools.count(1)
        self._held: dict[int, tuple[Adapter, int, dict[str, torch.Tensor]]] = {}

    def check(self, plan: Plan, adapter: Adapter) -> None:
        self.lora.check(plan, adapter)

    def hold(self, adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> tuple[int, str, str]:
        lora_id = next(self._ids)
        self._held[lora_id] = (adapter, version, tensors)
        return lora_id, f"{adapter.name}/{version}/{lora_id}", source_digest(tensors)

    def drop(self, *lora_ids: int) -> None:
        for lora_id in lora_ids:
            self._held.pop(lora_id, None)

    def install_on_loop(self, lora_id: int) -> Any:
        """The work that makes held version `lora_id` served (run on the engine loop's thread)."""
        adapter, version, tensors = self._held.pop(lora_id)
        return lambda: self.lora.install(adapter, version, tensors)


class _ControlThread:
    """An event loop on a daemon thread, where the server's sync control lives."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="weightsync-control", daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()


WARM_UP_MAX_STEPS = 64
"""Steps the warm-up may take to produce its one token (an engine may schedule before it runs)."""
WARM_UP_ID = "weightsync-warm-up"


def warm_up(engine: StepEngine, model: str) -> None:
    """Generate one token from a one-token prompt, as a request would, before serving: a server
    that started but cannot generate would answer every request with nothing (in an RL loop,
    silent empty rollouts). It runs on the weights the engine starts with (dummy ones, before any
    sync), through the `add_request`/`step` path every request takes.

    Raises:
        ConfigError: the engine cannot run this model (its step raised, or it produced nothing).
    """
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        engine.add_request(WARM_UP_ID, [0], params)
        tokens: list[int] = []
        for _ in range(WARM_UP_MAX_STEPS):
            for output in engine.step():
                tokens += output.new_token_ids
            if not engine.has_unfinished():
                break
    except Exception as exc:
        with contextlib.suppress(Exception):
            engine.abort(WARM_UP_ID)
        raise ConfigError(
            f"the {engine.name} engine cannot run {model}: a one-token warm-up generation failed: {exc}"
        ) from exc
    if engine.has_unfinished() or not tokens:
        engine.abort(WARM_UP_ID)
        raise ConfigError(
            f"the {engine.name} engine cannot run {model}: a one-token warm-up generation produced no token "
            f"in {WARM_UP_MAX_STEPS} steps"
        )
    log.info("warm-up: the %s engine generated a token", engine.name)


class RolloutServer:
    """StepEngine + loop + control + receiver of one server; the HTTP app (`create_app`) serves it."""

    def __init__(self, config: ServeConfig, engine: StepEngine | None = None) -> None:
        self.config = config
        self.tokenizer, self.no_tokenizer = load_tokenizer(config.model, config.chat_template)
        """The model's tokenizer, or None and why: then text prompts are refused (token ids work)."""
        if self.tokenizer is None:
            log.warning("%s: text prompts will be refused; prompts of token ids are served", self.no_tokenizer)
        elif not self.tokenizer.chat_template:
            log.warning(NO_CHAT_TEMPLATE, config.model)
        self.engine = engine or build_engine(config)
        try:
            warm_up(self.engine, config.model)
        except BaseException:
            self.engine.close()
            raise
        self.metrics = ServerMetrics()
        initial = AUTO_VERSION if config.load_format == "auto" else None
        self.loop = EngineLoop(self.engine, version=initial, on_failure=lambda exc: self.metrics.engine_failures.inc())
        lora = self.engine.lora
        adapters = HeldAdapters(lora, (config.model_name,)) if lora is not None else None
        self._thread = _ControlThread()
        self.control = SyncControl(
            LoopEngine(self.loop, adapters, config.receiver.timeout),
            mode=config.sync_mode,
            drain_timeout=config.drain_timeout,
            sync_timeout=config.receiver.timeout,
            metrics=self.metrics,
            version=initial,
            lora_versions=config.lora_versions if adapters is not None else 0,
            loop=self._thread.loop,
        )
        sink = ControlledSink(
            self.engine.weight_sink(),
            LocalBell(self.control),
            rank=0,
            drain_timeout=config.drain_timeout,
            timeout=config.receiver.timeout,
            loras=adapters,
        )
        self.receiver = WeightReceiver(sink, config.transport, options=config.receiver).start()
        self.receiver.watch(sink.observe)
        self.served = Served(
            engine="hf",
            model=config.model_name,
            transport=config.transport,
            addresses=(self.receiver.address,),
            weight_bytes=self.engine.weight_bytes(),
        )
        self.loop.start()

    @property
    def version(self) -> int | None:
        """The version served now (None: nothing servable)."""
        return self.control.version

    def health(self) -> Health:
        return self.control.health()

    def weight_info(self) -> dict[str, object]:
        return self.control.weight_info(self.served)

    def pause(self, mode: PauseMode, timeout: float) -> bool:
        """Hold generation paused for the user, as POST /pause does; True once parked."""
        return self._thread.run(self.control.pause("user", mode, timeout))

    def resume(self) -> None:
        self._thread.run(self.control.resume("user"))

    def close(self) -> None:
        """Stop receiving, end every request, release the engine."""
        self.receiver.close()
        self.control.close()
        self.loop.close()
        self._thread.close()
        self.engine.close()
