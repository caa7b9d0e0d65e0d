"""A rollout server with its HTTP API on a background thread, for hosts that own the main
thread themselves: a Ray actor, a test, a notebook. `weightsync serve` runs the same servers in
the foreground: weightsync's own app around the transformers engine ("hf"), or vLLM's own
OpenAI server with weightsync's backend in every worker ("vllm", weightsync.integrations.vllm)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsync.errors import ResourceError
from weightsync.serving.config import ServeConfig
from weightsync.serving.engines import ENGINES, engine_adapter
from weightsync.serving.foreground import Ready, ServeOptions

if TYPE_CHECKING:
    from weightsync.serving.hf.server import RolloutServer

__all__ = ["BackgroundServer", "bind"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one).

    Raises:
        ResourceError: the address cannot be bound (in use, not this host's, not permitted).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ResourceError(f"cannot listen on {host}:{port}: {exc}") from exc
    # Listen now, before the URL is handed out: a client that connects while uvicorn is still
    # starting waits in the backlog instead of being refused.
    sock.listen(128)
    return sock


class BackgroundServer:
    """The rollout server of `config` on a daemon thread, listening on `config.host`: the engine's
    adapter serving as `weightsync serve` does, on an event loop of its own.

    Args:
        config: what to serve.
        port: the HTTP port (0: any free one).
        start_timeout: seconds the server may take to start (None: the engine's `start_s`).

    Raises:
        ConfigError: the config is refused (vLLM refused its arguments, say).
        ResourceError: the server did not start within `start_timeout`, or failed to.
    """

    def __init__(self, config: ServeConfig, port: int = 0, start_timeout: float | None = None) -> None:
        self.config = config
        self.server: RolloutServer | None = None
        """The transformers engine's server (None for vLLM, whose parts live in its own processes)."""
        self.addresses: list[str] = []
        """Where a sender pushes weights to this server: one receiver per worker."""
        adapter = engine_adapter(config.engine)
        adapter.check(config)  # a refusal of the engine's arguments, raised here
        self._sock = bind(config.host, port)
        host, bound_port = self._sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound_port}"
        try:
            self._close = self._start(
                adapter, ENGINES[config.engine].start_s if start_timeout is None else start_timeout
            )
        except BaseException:
            self._sock.close()
            raise

    def _start(self, adapter: Any, start_timeout: float) -> Callable[[float], None]:
        ready = threading.Event()
        started: dict[str, Any] = {}

        def announce(up: Ready) -> None:
            self.addresses, self.server = list(up.addresses), up.server
            ready.set()

        async def main() -> None:
            started["loop"], started["stop"] = asyncio.get_running_loop(), asyncio.Event()
            await adapter.serve(
                self.config, self._sock, ServeOptions(announce=announce, log_level="warning", stop=started["stop"])
            )

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:
                started["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=run, name=f"weightsync-{self.config.engine}-server", daemon=True)
        thread.start()

        def close(timeout: float) -> None:
            loop, stop = started.get("loop"), started.get("stop")
            if loop is not None and stop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(stop.set)
            thread.join(timeout)
            # vLLM's engine client leaves its ZeroMQ contexts to the garbage collector, which
            # warns about each (ResourceWarning) whenever it gets to them: collect them now,
            # the engine shut down, rather than in the middle of the caller's later work.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()

        if not ready.wait(start_timeout) or "error" in started:
            close(start_timeout)
            error = started.get("error")
            if isinstance(error, Exception):
                raise error
            raise ResourceError(f"the {self.config.engine} server on {self.url} did not start within {start_timeout} s")
        return close

    def weight_info(self) -> dict[str, Any]:
        """What GET /weight_info answers (version, state, addresses, digest, last sync)."""
        if self.server is not None:
            return self.server.weight_info()
        from weightsync.client import RolloutClient

        client = RolloutClient(self.url, auth_token=self.config.auth_token)
        try:
            return client.weight_info()
        finally:
            client.close()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the HTTP server, then the engine and receivers."""
        self._close(timeout)
        self._sock.close()
