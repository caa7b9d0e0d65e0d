"""A transformers rollout server that answers from the moment its port listens.

Building the engine takes seconds (its import, the model, the warm-up). `weightsync serve` starts
its HTTP server first and builds the `RolloutServer` on a background thread, so a probe never
meets an open port that does not answer: until the server is up, `front` (the HTTP face's
`Starting`) answers /health and every endpoint with a 503 naming the state ("starting", "loading
engine", or "failed" with the error that then stops the process), then it serves the app.

    check, preload, serve            the engine adapter's entry points (serving/engines.py)
    Startup(config).start(on_done)   build on a thread; on_done() when it is up or has failed
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
from collections.abc import Callable, Sequence

from weightsync.errors import ConfigError
from weightsync.serving.config import Health, ServeConfig
from weightsync.serving.engines import require_engine
from weightsync.serving.foreground import Ready, ServeOptions, http_server, stopped_by_signals
from weightsync.serving.hf.app import create_app
from weightsync.serving.hf.server import RolloutServer
from weightsync.serving.http import Starting

__all__ = ["Startup", "check", "preload", "serve"]

log = logging.getLogger(__name__)


def preload(config: ServeConfig) -> None:
    """Call before the port listens: import what the build imports, and freeze the heap.

    Both hold the interpreter for long stretches when done on the build thread: imports, and full
    garbage collections (each scans every object there is). Objects frozen now are skipped by
    those collections, and by the interpreter's own while the server runs.
    """
    require_engine(config.engine)
    from weightsync.serving.hf.engine import HFEngine

    HFEngine.preload(config.model)
    gc.collect()
    gc.freeze()


def check(config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
    """Raises ConfigError for engine arguments: the transformers engine takes none."""
    if extra_args:
        raise ConfigError("--engine-args are for --engine vllm")


async def serve(config: ServeConfig, sock: socket.socket, options: ServeOptions) -> list[int]:
    """Serve on `sock` until SIGTERM/SIGINT (or `options.stop` is set): 503s while the engine
    builds on a thread, then the app. The engine lives in this process: there is nothing to
    `note`, and its close is not bounded.

    Raises:
        ConfigError: engine arguments were given, or the engine cannot run the model.
    """
    check(config, options.extra_args)
    loop = asyncio.get_running_loop()
    startup = Startup(config)
    http = http_server(startup.front, options.log_level)

    def built() -> None:  # on the build thread
        server = startup.server
        if server is None:  # could not start: stop serving, and raise why below
            http.should_exit = True
            return
        loop.call_soon_threadsafe(options.announce, Ready((server.receiver.address,), server))

    with stopped_by_signals(http, options.stop) as caught:
        try:
            startup.start(built)
            await http.serve(sockets=[sock])
        finally:
            startup.close()
    if startup.error is not None:
        raise startup.error
    return caught


class Startup:
    """One `RolloutServer` in the making, and the app that answers for it meanwhile (`front`).

    Args:
        config: what to serve.
    """

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.server: RolloutServer | None = None
        self.error: BaseException | None = None
        """Why the server could not start (then the process stops with it)."""
        self.front = Starting()
        self._lock = threading.Lock()
        self._closed = False

    def start(self, on_done: Callable[[], None]) -> None:
        """Build the server on a daemon thread; `on_done()` is called from it once the server is
        up (`server` set) or could not start (`error` set)."""
        threading.Thread(target=self._build, args=(on_done,), name="weightsync-startup", daemon=True).start()

    def _build(self, on_done: Callable[[], None]) -> None:
        what = f"the {self.config.engine} engine for {self.config.model}"
        self.front.health = Health(False, "loading engine", f"loading {what}")
        log.info("loading %s", what)
        try:
            server = RolloutServer(self.config)
        except BaseException as exc:
            self.error = exc
            self.front.health = Health(False, "failed", f"the server could not start: {exc}")
            log.debug("start-up failed", exc_info=exc)
        else:
            with self._lock:
                if self._closed:  # stopped while we built: nobody will serve from it
                    server.close()
                    return
                self.server = server
                self.front.app = create_app(server)
        on_done()

    def close(self) -> None:
        """Close the server if it is up. A build still running is not waited for: it closes
        what it built when it ends (the process usually exits first). The heap `preload` froze
        is unfrozen, so that what the interpreter tears down at exit is collected as usual."""
        with self._lock:
            self._closed = True
            server, self.server = self.server, None
        self.front.health = Health(False, "failed", "the server is stopping")
        self.front.app = None
        if server is not None:
            server.close()
        gc.unfreeze()
