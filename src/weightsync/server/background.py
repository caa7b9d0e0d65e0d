"""A rollout server with its HTTP API on a background thread, for hosts that own the main
thread themselves: a Ray actor, a test, a notebook. `weightsync serve` runs the same app in
the foreground."""

from __future__ import annotations

import socket
import threading
import time

from weightsync.errors import ResourceError
from weightsync.server.runtime import RolloutServer, ServeConfig

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
    """`RolloutServer(config)` behind uvicorn on a daemon thread, listening on `config.host`.

    Args:
        config: what to serve.
        port: the HTTP port (0: any free one).
        start_timeout: seconds uvicorn may take to start.
    """

    def __init__(self, config: ServeConfig, port: int = 0, start_timeout: float = 30.0) -> None:
        import uvicorn

        from weightsync.server.app import create_app

        self.server = RolloutServer(config)
        try:
            self._sock = bind(config.host, port)
            host, bound_port = self._sock.getsockname()[:2]
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound_port}"
            self._http = uvicorn.Server(uvicorn.Config(create_app(self.server), log_level="warning", lifespan="off"))
            self._thread = threading.Thread(
                target=self._http.run, kwargs={"sockets": [self._sock]}, name="weightsync-http", daemon=True
            )
            self._thread.start()
            deadline = time.monotonic() + start_timeout
            while not self._http.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise ResourceError(f"the HTTP server on {self.url} did not start within {start_timeout} s")
                time.sleep(0.01)
        except BaseException:
            self.server.close()
            raise

    @property
    def address(self) -> str:
        """Where a sender pushes weights to this server."""
        return self.server.receiver.address

    def close(self, timeout: float = 30.0) -> None:
        """Stop the HTTP server, then the engine and receiver."""
        self._http.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        self.server.close()
