"""What a rollout server runs, whatever its engine: `ServeConfig` (checked against the engines of
engines.py), the states a server reports (`Health`), and the dtype a model's config names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from weightsync.auth import check_bind, resolve_token
from weightsync.errors import ConfigError
from weightsync.options import ReceiverOptions
from weightsync.serving.body_limit import default_max_request_bytes
from weightsync.transports import get_transport, serving_transports

__all__ = [
    "AUTO_VERSION",
    "PAUSE_MODES",
    "Health",
    "LoadFormat",
    "PauseMode",
    "ServeConfig",
    "ServerState",
]

LoadFormat = Literal["dummy", "auto"]
"""dummy: build from config.json only, weights uninitialised, serve nothing until a sync commits.
auto: load the checkpoint from the model dir (standalone/debugging), servable at once."""

PauseMode = Literal["wait", "abort", "keep"]
"""How generation pauses (as vLLM's `pause_generation`): wait (finish what runs, admit nothing),
abort (end what runs), keep (freeze what runs where it is; it continues on resume)."""
PAUSE_MODES: tuple[PauseMode, ...] = ("wait", "abort", "keep")
"""Every PauseMode; `mode in PAUSE_MODES` narrows a str to one."""

AUTO_VERSION = 0
"""The version a server started with --load-format auto serves: the checkpoint on disk."""

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
    """What a rollout server runs: `weightsync serve`, a `BackgroundServer`, each `RolloutFleet` actor.

    Attributes:
        model: model directory (config.json, tokenizer; the checkpoint for load_format "auto").
        engine: the engine's name in `ENGINES` ("hf", "vllm" or "sglang").
        load_format: "dummy" (serve nothing until the first sync) or "auto".
        transport: the receiver's transport, one that reaches another process
            (`serving_transports()`: "shm", "tcp", "collective", "nixl", "cudaipc").
        receiver: how each worker's weight receiver listens and what it accepts (its interface
            and port for networked transports, its timeout: the bound on every wait inside a
            sync, the weakest verification it accepts, its bucket limit); its token is the
            server's `auth_token`.
        sync_mode: how generation pauses for a sync: "wait", "abort" or "keep" (not sglang).
        ready_timeout: seconds a request waits for a committed, intact version before a 503.
        drain_timeout: seconds a sync waits for generation to pause before it is refused.
        served_model_name: the name /v1/models reports (default: the model dir's name).
        auth_token: the shared secret (default $WEIGHTSYNC_AUTH_TOKEN): pushes must prove it
            (HMAC), HTTP endpoints other than /health and /ping need `Authorization: Bearer
            <token>`. Required when `host` or the receiver's host (networked transports) is not
            loopback.
        allow_unauthenticated_generation: let every /v1/ route through without the token.
        host: the HTTP interface (checked here; `weightsync serve` binds it).
        staged: land syncs in a standby copy of the weights, and make it live only at commit (hf:
            a storage swap; vllm and sglang: a load from host memory); the engine serves during
            the transfer.
        max_request_bytes: the largest HTTP request body accepted, checked before it is parsed
            (None: 256 bytes per token of the model's context, at least 1 MiB).
        chat_template: a Jinja chat template file, used instead of the tokenizer's own (None:
            the tokenizer's; a server whose tokenizer has none says so at start-up).
        max_lora_rank: serve LoRA adapters pushed to it, of rank up to this (0: refuse them;
            hf and vllm only).
        lora_versions: versions of each adapter kept resident (hf: and any a request still runs on).
    """

    model: str
    engine: str = "hf"
    load_format: LoadFormat = "dummy"
    transport: str = "shm"
    receiver: ReceiverOptions = dataclasses.field(default_factory=ReceiverOptions)
    sync_mode: PauseMode = "wait"
    ready_timeout: float = 8.0
    drain_timeout: float = 60.0
    served_model_name: str | None = None
    auth_token: str | None = None
    allow_unauthenticated_generation: bool = False
    host: str = "127.0.0.1"
    staged: bool = False
    max_request_bytes: int | None = None
    chat_template: str | None = None
    max_lora_rank: int = 0
    lora_versions: int = 2

    def __post_init__(self) -> None:
        from weightsync.serving.engines import ENGINES  # the registry's contract names this class

        object.__setattr__(self, "auth_token", resolve_token(self.auth_token))
        if not isinstance(self.receiver, ReceiverOptions):
            raise ConfigError(f"receiver must be a ReceiverOptions, got {self.receiver!r}")
        object.__setattr__(self, "receiver", dataclasses.replace(self.receiver, auth_token=self.auth_token))
        check_bind(self.host, self.auth_token, "the rollout server's HTTP API")
        if get_transport(self.transport).networked:
            check_bind(self.receiver.host, self.auth_token, "the rollout server's weight receiver")
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"model {self.model!r} is not a directory with a config.json")
        choices = {
            "engine": tuple(ENGINES),
            "load_format": ("dummy", "auto"),
            "transport": tuple(serving_transports()),
            "sync_mode": PAUSE_MODES,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(f"{field} must be one of {', '.join(allowed)}; got {getattr(self, field)!r}")
        for field in ("ready_timeout", "drain_timeout"):
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
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def request_limit(self) -> int:
        """The largest request body accepted, in bytes."""
        return self.max_request_bytes or default_max_request_bytes(self.model)


def model_dtype(model_dir: str) -> str:
    """The dtype the model's config.json names ("dtype", or the older "torch_dtype"), else
    "auto": an engine's "auto" may run a float32 checkpoint in bfloat16 on a CPU, and a push of
    that checkpoint would then be refused."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if isinstance(value, str) else "auto"
