"""The engines a rollout server runs, each by its adapter: one line per engine. Plain data, cheap to
import (the command's --help reads it); an engine's own packages are imported only when chosen."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from weightsync.errors import ConfigError

__all__ = ["ENGINES", "EngineEntry", "engine_adapter", "require_engine"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine a server runs: its adapter's module (under serving/<engine>/), the package the
    engine runs on (imported first, to fail early where it is missing), and how to install it.

    The adapter's module supplies three entry points:

        check(config, extra_args)   refuse what it cannot serve, before the port is taken
        preload(config)             imports and a heap freeze before the port listens (the
                                    command only, not a server on a thread)
        serve(config, sock, *, extra_args, announce, log_level, stop, note, shutdown_timeout)
                                    serve until SIGTERM/SIGINT or `stop` (serving/foreground.py);
                                    `announce(Ready)` once it serves; `note()` while the engine's
                                    processes start and stop (serving/footprint.py); returns the
                                    signals caught
    """

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
SGLang's own server with weightsync's loader in its workers. Adding an
engine is one adapter module (serving/<engine>/) and one line here."""


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


def engine_adapter(name: str) -> Any:
    """Engine `name`'s adapter module (its `check`, `preload` and `serve`), once its engine's
    package imports here.

    Raises:
        ConfigError: the engine is unknown, or its package is missing here.
    """
    require_engine(name)
    return importlib.import_module(ENGINES[name].adapter)
