"""One rollout server's parts, built from one config: engine, loop, sink, receiver, metrics.

The receiver lives in the server process and lands syncs straight into the engine's live tensors
(through `ServerSink`), so the process holds one copy of the model.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from pathlib import Path
from typing import Literal

from weightsync.auth import check_bind, resolve_token
from weightsync.checksum import VERIFY_MODES, Verify
from weightsync.engines.base import Engine, LoadFormat
from weightsync.errors import ConfigError
from weightsync.messages import SyncTimes
from weightsync.options import ReceiverOptions
from weightsync.receiver import ReceiverStatus, WeightReceiver
from weightsync.server.body_limit import default_max_request_bytes
from weightsync.server.loop import PAUSE_MODES, EngineLoop, PauseMode
from weightsync.server.metrics import ServerMetrics
from weightsync.server.sync import ServerSink
from weightsync.server.warmup import NO_CHAT_TEMPLATE, load_tokenizer, warm_up
from weightsync.transports import get_transport, serving_transports

__all__ = [
    "ENGINES",
    "FAILED_STEPS_UNHEALTHY",
    "EngineName",
    "Health",
    "RolloutServer",
    "ServeConfig",
    "ServerState",
    "build_engine",
    "engine_class",
    "require_engine",
]

log = logging.getLogger(__name__)

EngineName = Literal["hf", "vllm"]
"""The engines a server runs: "hf" in this process behind weightsync's own app (`RolloutServer`),
"vllm" as vLLM's own server with weightsync's backend in its workers (weightsync.integrations.vllm)."""

ENGINES: dict[str, str] = {"hf": "weightsync.engines.hf:HFEngine"}
"""In-process engine name -> "module:Class", imported only when chosen."""

ENGINE_PACKAGES: dict[str, str] = {"hf": "transformers", "vllm": "vllm"}
"""Engine name -> the package it runs on, imported by `require_engine` to fail early where it is missing."""

AUTO_VERSION = 0
"""The version a server started with --load-format auto serves: the checkpoint on disk."""

FAILED_STEPS_UNHEALTHY = 3
"""Engine steps failing in a row that make /health answer 503 ("failed"), until one succeeds."""

ServerState = Literal["starting", "loading engine", "waiting for weights", "syncing", "ready", "dirty", "failed"]
"""What /health names: the first two before the engine is up (`weightsync serve` answers from the
moment its port listens), then the weights' state, or "failed" (the engine fails its steps, or
failed to start)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Health:
    """GET /health: 200 when `ok`, else 503 with `reason`."""

    ok: bool
    state: ServerState
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """What `weightsync serve` runs.

    Attributes:
        model: model directory (config.json, tokenizer; the checkpoint for load_format "auto").
        engine: "hf" or "vllm".
        load_format: "dummy" (serve nothing until the first sync) or "auto".
        transport: the receiver's transport, "shm", "tcp" or "collective".
        receiver_host: interface the tcp or collective receiver listens on.
        receiver_port: its port (0: any free one).
        sync_mode: how the engine loop pauses for a sync: "wait", "abort" or "keep".
        ready_timeout: seconds a request waits for the first committed version before a 503.
        drain_timeout: seconds a sync waits for the loop to park before it is refused.
        sync_timeout: the receiver's bound on every wait inside a sync.
        served_model_name: the name /v1/models reports (default: the model dir's name).
        verify: the weakest verification the receiver accepts ("off" or "bucket").
        auth_token: the shared secret (default $WEIGHTSYNC_AUTH_TOKEN): pushes must prove it
            (HMAC), HTTP control endpoints need `Authorization: Bearer <token>`. Required when
            `host` or `receiver_host` is not loopback.
        allow_unauthenticated_generation: let /v1/completions and /v1/models through without it.
        host: the HTTP interface (checked here; `weightsync serve` binds it).
        staged: land syncs in a standby copy of the weights, and make it live only at commit (hf:
            a storage swap; vLLM: a reload from host memory); the engine serves during the transfer.
        max_request_bytes: the largest HTTP request body accepted, checked before it is parsed
            (None: 256 bytes per token of the model's context, at least 1 MiB).
        chat_template: a Jinja chat template file, used instead of the tokenizer's own (None:
            the tokenizer's; a server whose tokenizer has none says so at start-up).
        max_lora_rank: serve LoRA adapters pushed to it, of rank up to this (0: refuse them).
        lora_versions: versions of each adapter kept resident (hf: and any a request still runs on).
    """

    model: str
    engine: EngineName = "hf"
    load_format: LoadFormat = "dummy"
    transport: str = "shm"
    receiver_host: str = "127.0.0.1"
    receiver_port: int = 0
    sync_mode: PauseMode = "wait"
    ready_timeout: float = 30.0
    drain_timeout: float = 60.0
    sync_timeout: float = 60.0
    served_model_name: str | None = None
    verify: Verify = "off"
    auth_token: str | None = None
    allow_unauthenticated_generation: bool = False
    host: str = "127.0.0.1"
    staged: bool = False
    max_request_bytes: int | None = None
    chat_template: str | None = None
    max_lora_rank: int = 0
    lora_versions: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "auth_token", resolve_token(self.auth_token))
        check_bind(self.host, self.auth_token, "the rollout server's HTTP API")
        if get_transport(self.transport).networked:
            check_bind(self.receiver_host, self.auth_token, "the rollout server's weight receiver")
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"model {self.model!r} is not a directory with a config.json")
        choices = {
            "engine": tuple(ENGINE_PACKAGES),
            "load_format": ("dummy", "auto"),
            "transport": tuple(serving_transports()),
            "sync_mode": PAUSE_MODES,
            "verify": VERIFY_MODES,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(f"{field} must be one of {', '.join(allowed)}; got {getattr(self, field)!r}")
        for field in ("ready_timeout", "drain_timeout", "sync_timeout"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{field} must be a non-negative number of seconds, got {value!r}")
        limit = self.max_request_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1024):
            raise ConfigError(f"max_request_bytes must be an integer of at least 1024, got {limit!r}")
        for field, least in (("max_lora_rank", 0), ("lora_versions", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"{field} must be an integer of at least {least}, got {value!r}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"chat template {self.chat_template!r} is not a file")

    @property
    def receiver_options(self) -> ReceiverOptions:
        """The options of this server's weight receiver."""
        return ReceiverOptions(
            host=self.receiver_host,
            port=self.receiver_port,
            timeout=self.sync_timeout,
            verify=self.verify,
            auth_token=self.auth_token,
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def request_limit(self) -> int:
        """The largest request body accepted, in bytes."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return default_max_request_bytes(self.model)


def require_engine(name: str) -> None:
    """Import the package engine `name` runs on (vLLM is heavy and optional, so only when chosen).

    Raises:
        ConfigError: the engine is unknown, or its package is missing or does not import here.
    """
    if name not in ENGINE_PACKAGES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINE_PACKAGES)}; got {name!r}")
    try:
        importlib.import_module(ENGINE_PACKAGES[name])
    except (ImportError, RuntimeError) as exc:  # RuntimeError: a vLLM build that does not match torch
        hint = "run scripts/install-vllm.sh (vLLM's CPU build; pip install vllm on a GPU host)"
        if name != "vllm":
            hint = "pip install -e '.[hf]' in your weightsync checkout"
        raise ConfigError(f"engine {name!r} is not available here ({exc}); {hint}") from exc


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
