"""A rollout server's port served until it is stopped, the same way for every engine adapter.

    http_server(app, log_level)   uvicorn without its own signal handling
    stopped_by_signals(http)      SIGTERM and SIGINT stop it gracefully; yields the signals caught
    stop_on(event, http)          a `stop` event (a BackgroundServer's close) stops it too
    Ready                         what an adapter's `serve` announces once it serves

An engine adapter's `serve(config, sock, ...)` runs on an event loop until one of those stops it,
and returns the signals caught: the command turns a SIGINT into the exit status of Ctrl-C (130),
a SIGTERM, how a server is stopped, into 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn

__all__ = ["GRACEFUL_SHUTDOWN_S", "Ready", "http_server", "stop_on", "stopped_by_signals"]

GRACEFUL_SHUTDOWN_S = 5
"""Seconds requests in flight get to finish when the server is stopped."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """A server that serves: where its workers' receivers listen, and (transformers) the
    in-process server itself, for a host that runs it on a thread (`BackgroundServer.server`)."""

    addresses: tuple[str, ...]
    server: Any = None


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM and SIGINT are `stopped_by_signals`'."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: Any, log_level: str) -> uvicorn.Server:
    """uvicorn serving `app`: weightsync's log level, access lines at debug only."""
    return _Server(
        uvicorn.Config(
            app,
            log_level=max(logging.WARNING, logging.getLevelName(log_level.upper())),
            access_log=log_level == "debug",
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )


@contextlib.contextmanager
def stopped_by_signals(http: uvicorn.Server) -> Iterator[list[int]]:
    """SIGTERM/SIGINT stop the server gracefully; yields the signals caught (none are installed
    off the main thread: there the caller stops it, with `stop_on`)."""
    loop = asyncio.get_running_loop()
    caught: list[int] = []

    def stop(sig: int) -> None:
        caught.append(sig)
        http.should_exit = True

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: the caller stops us
            loop.add_signal_handler(sig, stop, sig)
            installed.append(sig)
    try:
        yield caught
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def stop_on(stop: asyncio.Event, http: uvicorn.Server) -> None:
    await stop.wait()
    http.should_exit = True
