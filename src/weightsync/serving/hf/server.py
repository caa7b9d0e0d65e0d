"""One rollout server's parts, built from one config: engine, loop, sink, receiver, metrics.

The receiver lives in the server process and lands syncs straight into the engine's live tensors
(through `ServerSink`), so the process holds one copy of the model.
"""

from __future__ import annotations

import importlib
import logging

from weightsync.errors import ConfigError
from weightsync.messages import SyncTimes
from weightsync.receiver import ReceiverStatus, WeightReceiver
from weightsync.serving.config import AUTO_VERSION, Health, PauseMode, ServeConfig, require_engine
from weightsync.serving.hf.base import Engine
from weightsync.serving.hf.loop import EngineLoop
from weightsync.serving.hf.sync import ServerSink
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.warmup import NO_CHAT_TEMPLATE, load_tokenizer, warm_up

__all__ = ["ENGINES", "FAILED_STEPS_UNHEALTHY", "RolloutServer", "build_engine", "engine_class"]

log = logging.getLogger(__name__)

ENGINES: dict[str, str] = {"hf": "weightsync.serving.hf.engine:HFEngine"}
"""In-process engine name -> "module:Class", imported only when chosen."""

FAILED_STEPS_UNHEALTHY = 3
"""Engine steps failing in a row that make /health answer 503 ("failed"), until one succeeds."""


def engine_class(name: str) -> type[Engine]:
    """Import in-process engine `name`'s class.

    Raises:
        ConfigError: the engine is not an in-process one, or its package is missing here.
    """
    if name not in ENGINES:
        raise ConfigError(
            f"engine {name!r} does not run inside weightsync's own server; the vllm engine is vLLM's own "
            "server (weightsync serve --engine vllm, or BackgroundServer)"
        )
    require_engine(name)
    module_name, _, class_name = ENGINES[name].partition(":")
    cls: type[Engine] = getattr(importlib.import_module(module_name), class_name)
    return cls


def build_engine(config: ServeConfig) -> Engine:
    """Build the in-process engine `config` names (its class imported by `engine_class`)."""
    engine: Engine = engine_class(config.engine)(  # type: ignore[call-arg]
        config.model,
        load_format=config.load_format,
        staged=config.staged,
        max_lora_rank=config.max_lora_rank,
        lora_versions=config.lora_versions,
    )
    return engine


class RolloutServer:
    """Engine + loop + receiver of one server; the HTTP app (`create_app`) reads from it."""

    def __init__(self, config: ServeConfig, engine: Engine | None = None) -> None:
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
        self.loop = EngineLoop(self.engine, version=initial, on_failure=self._engine_failed)
        if initial is not None:
            self.metrics.version.set(initial)
        self.sink = ServerSink(
            self.engine.weight_sink(),
            self.loop,
            mode=config.sync_mode,
            drain_timeout=config.drain_timeout,
            metrics=self.metrics,
            model_name=config.model_name,
        )
        self.receiver = WeightReceiver(self.sink, config.transport, options=config.receiver_options)
        self.receiver.watch(self._observe)
        self.loop.start()

    def _observe(self, before: ReceiverStatus, after: ReceiverStatus) -> None:
        if after.times is not None and after.times is not before.times:
            self.metrics.observe_times(after.times, after.mode)

    @property
    def version(self) -> int | None:
        """The version served now (None: nothing servable)."""
        return self.loop.version

    def state(self) -> str:
        """The receiver's state, except that a server started from the checkpoint is "ready"."""
        state = self.receiver.state
        if state == "empty" and self.loop.version is not None:
            return "ready"
        return state

    def health(self) -> Health:
        """Serving or not, in which state, and why not: serving once a version is committed and
        intact, and while the engine does not fail step after step."""
        state = self.state()
        if self.loop.failed_steps >= FAILED_STEPS_UNHEALTHY:
            reason = f"the engine failed its last {self.loop.failed_steps} steps: {self.loop.last_failure}"
            return Health(False, "failed", reason)
        if state == "dirty":
            return Health(False, "dirty", f"weights are dirty: {self.receiver.last_error}; push a new version")
        if self.loop.version is None:
            if state == "syncing":
                return Health(False, "syncing", "the first weight sync is in progress")
            reason = "no weights committed yet (started with --load-format dummy): push weights first"
            return Health(False, "waiting for weights", reason)
        return Health(True, "syncing" if state == "syncing" else "ready")

    def _engine_failed(self, exc: BaseException) -> None:
        self.metrics.engine_failures.inc()

    def weight_info(self) -> dict[str, object]:
        return {
            "version": self.loop.version,
            "state": self.state(),
            "last_error": self.receiver.last_error,
            "last_sync": self.sink.stats.to_json() | {"times": _times_json(self.receiver.status.times)},
            "content_digest": self.receiver.content_digest,
            "transport": self.config.transport,
            "addresses": [self.receiver.address],
            "sync_mode": self.config.sync_mode,
            "paused_by": self.loop.paused_by,
            "weight_bytes": self.engine.weight_bytes(),
            "engine": self.engine.name,
            "model": self.config.model_name,
            "adapters": [served.to_json() for served in self.engine.adapters()],
        }

    def pause(self, mode: PauseMode, timeout: float) -> bool:
        return self.loop.pause("user", mode, timeout)

    def resume(self) -> None:
        self.loop.resume("user")

    def close(self) -> None:
        """Stop receiving, end every request, release the engine."""
        self.receiver.close()
        self.loop.close()
        self.engine.close()


def _times_json(times: SyncTimes | None) -> dict[str, float] | None:
    """Where the last committed sync's time went, in seconds, or None before the first."""
    if times is None:
        return None
    return {field: round(getattr(times, field), 6) for field in times.__struct_fields__}
