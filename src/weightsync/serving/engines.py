"""The engines a rollout server runs, each by its adapter: one line per engine, and the contract
every adapter's module keeps (`EngineAdapter`). Plain data, cheap to import (the command's --help
reads it); an engine's own packages are imported only when chosen."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

from weightsync.errors import ConfigError

if TYPE_CHECKING:
    import socket

    from weightsync.serving.config import ServeConfig
    from weightsync.serving.foreground import ServeOptions

__all__ = ["ENGINES", "EngineAdapter", "EngineEntry", "engine_adapter", "require_engine"]


class EngineAdapter(Protocol):
    """What an engine's adapter module (serving/<engine>/) supplies: `weightsync serve` and
    `BackgroundServer` run every engine through these three."""

    def check(self, config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
        """Raise ConfigError for what the adapter cannot serve, before the port is taken."""

    def preload(self, config: ServeConfig) -> None:
        """Imports (and a heap freeze) before the port listens: the command only, not a server
        on a thread."""

    async def serve(self, config: ServeConfig, sock: socket.socket, options: ServeOptions) -> list[int]:
        """Serve on `sock` until SIGTERM/SIGINT or `options.stop` is set (serving/foreground.py).
        Returns the signals caught.

        Raises:
            ConfigError: the engine refused the arguments.
            ResourceError: the engine or its receivers could not start.
        """
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine a server runs: its adapter's module (under serving/<engine>/, an
    `EngineAdapter`), the package the engine runs on (imported first, to fail early where it is
    missing), and how to install it."""

    adapter: str
    package: str
    install: str
    start_s: float
    """Seconds a server of this engine may take to start by default (its imports, the model,
    the warm-up) on a busy 2-core host."""


ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry(
        "weightsync.serving.hf.startup", "transformers", "pip install -e '.[hf]' in your weightsync checkout", 60.0
    ),
    "vllm": EngineEntry(
        "weightsync.serving.vllm.server",
        "vllm",
        "run scripts/install-vllm.sh (vLLM's CPU build; pip install vllm on a GPU host)",
        300.0,
    ),
    "sglang": EngineEntry(
        "weightsync.serving.sglang.server",
        "sglang",
        "run scripts/install-sglang.sh DIR and use DIR/bin/weightsync (SGLang pins its own torch)",
        420.0,
    ),
}
"""The engines `weightsync serve --engine` runs: "hf" in this process behind weightsync's own
OpenAI subset, "vllm" as vLLM's own server with weightsync's backend in its workers, "sglang" as
SGLang's own server with weightsync's loader in its workers. Adding an engine is one adapter
module (serving/<engine>/: an engine with its own server and worker processes shares
serving/own_server.py, and its workers the worker kit, weightsync.workers) and one line here."""


def require_engine(name: str) -> None:
    """Import the package engine `name` runs on (vLLM is heavy and optional, so only when chosen).

    Raises:
        ConfigError: the engine is unknown, or its package is missing or does not import here.
    """
    if name not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}; got {name!r}")
    entry = ENGINES[name]
    try:
        importlib.import_module(entry.package)
    except (ImportError, RuntimeError) as exc:  # RuntimeError: a build that does not match torch
        raise ConfigError(f"engine {name!r} is not available here ({exc}); {entry.install}") from exc


def engine_adapter(name: str) -> EngineAdapter:
    """Engine `name`'s adapter module (its `check`, `preload` and `serve`), once its engine's
    package imports here.

    Raises:
        ConfigError: the engine is unknown, or its package is missing here.
    """
    require_engine(name)
    return cast("EngineAdapter", importlib.import_module(ENGINES[name].adapter))
