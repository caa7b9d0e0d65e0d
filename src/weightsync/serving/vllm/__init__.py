"""The vLLM adapter: vLLM's own OpenAI server over `AsyncLLM`, weightsync's backend in every worker
(integrations/vllm), and the server's sync control and HTTP face on top (serving/http.py).

The engine adapter's entry points (serving/hf/__init__.py lists what every adapter supplies);
importing this package imports nothing of vLLM: each entry point imports what it needs.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from weightsync.serving.config import ServeConfig
    from weightsync.serving.foreground import Ready

__all__ = ["check", "preload", "serve"]


def check(config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
    """Raises ConfigError when vLLM's own parser refuses the arguments."""
    from weightsync.serving.vllm.launch import vllm_namespace

    vllm_namespace(config, extra_args)


def preload(config: ServeConfig) -> None:
    from weightsync.serving.vllm.launch import preload as preload_vllm

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
    from weightsync.serving.vllm.server import serve as serve_vllm

    return await serve_vllm(
        config,
        sock,
        extra_args=extra_args,
        announce=announce,
        log_level=log_level,
        stop=stop,
        note=note,
        shutdown_timeout=shutdown_timeout,
    )
