"""The transformers engine's adapter: the engine on one thread of the server's process, behind
weightsync's own OpenAI subset, inside the HTTP face (serving/http.py).

What every engine adapter supplies (serving/config.py `ENGINES` names its package):

    check(config, extra_args)   refuse what it cannot serve, before the port is taken
    preload(config)             imports and a heap freeze, before the port listens (the command only)
    serve(config, sock, ...)    serve until stopped (serving/foreground.py); announce `Ready`

Importing this package imports nothing heavy: each entry point imports what it needs.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from weightsync.errors import ConfigError

if TYPE_CHECKING:
    import asyncio

    from weightsync.serving.config import ServeConfig
    from weightsync.serving.foreground import Ready

__all__ = ["check", "preload", "serve"]


def check(config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
    """Raises ConfigError for engine arguments: the transformers engine takes none."""
    if extra_args:
        raise ConfigError("--engine-args are for --engine vllm")


def preload(config: ServeConfig) -> None:
    from weightsync.serving.hf.startup import preload as preload_engine

    preload_engine(config)


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
    from weightsync.serving.hf.startup import serve as serve_engine

    check(config, extra_args)
    return await serve_engine(config, sock, announce=announce, log_level=log_level, stop=stop)
