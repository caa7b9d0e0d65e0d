"""A rollout server's port served until it is stopped, the same way for every engine adapter.

    http_server(app, log_level)   uvicorn without its own signal handling
    stopped_by_signals(http, stop)  SIGTERM and SIGINT stop it gracefully, and so does `stop`
                                  (a BackgroundServer's close); yields the signals caught
    Ready                         what an adapter's `serve` announces once it serves
    ServeOptions                  how the caller runs an adapter's `serve`
    EngineThread                  an engine built, and later shut down, on a thread of its own
    serve_engine(...)             the whole of an adapter's `serve` for an engine in processes
                                  of its own (vLLM, SGLang): the port answers while the engine
                                  builds, then the adapter's app, until stopped; the engine's
                                  processes inherit the token (workers.start.token_inherited)

An engine adapter's `serve(config, sock, options)` runs on an event loop until one of those stops it,
and returns the signals caught: the command turns a SIGINT into the exit status of Ctrl-C (130),
a SIGTERM, how a server is stopped, into 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import uvicorn

from weightsync.serving.config import Health, ServeConfig
from weightsync.serving.http import Starting
from weightsync.workers.start import token_inherited

__all__ = [
    "GRACEFUL_SHUTDOWN_S",
    "EngineThread",
    "Port",
    "Ready",
    "ServeOptions",
    "http_server",
    "serve_engine",
    "stopped_by_signals",
]

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
"""Seconds requests in flight get to finish when the server is stopped."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """A server that serves: where its workers' receivers listen, and (transformers) the
    in-process server itself, for a host that runs it on a thread (`BackgroundServer.server`)."""

    addresses: tuple[str, ...]
    server: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class ServeOptions:
    """How the caller runs an adapter's `serve` (engines.EngineAdapter): the engine's own
    arguments; `announce(Ready)` once it serves; `stop`, once set, stops it as SIGTERM does;
    `note()` while the engine's processes start and stop (serving/footprint.py); the seconds the
    engine's own shutdown gets (None: as long as it takes; a caller that bounds it ends what is
    left of the engine's processes, and need not wait for a build to stop)."""

    extra_args: Sequence[str] = ()
    announce: Callable[[Ready], None] = lambda ready: None
    log_level: str = "info"
    stop: asyncio.Event | None = None
    note: Callable[[], None] = lambda: None
    shutdown_timeout: float | None = None


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
def stopped_by_signals(http: uvicorn.Server, stop: asyncio.Event | None = None) -> Iterator[list[int]]:
    """SIGTERM/SIGINT stop the server gracefully, and so does `stop` once set; yields the signals
    caught (none are installed off the main thread: there the caller stops it, with `stop`)."""
    loop = asyncio.get_running_loop()
    caught: list[int] = []

    def on_signal(sig: int) -> None:
        caught.append(sig)
        http.should_exit = True

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: the caller stops us
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    watch = asyncio.create_task(_stop_on(stop, http)) if stop is not None else None
    try:
        yield caught
    finally:
        if watch is not None:
            watch.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _stop_on(stop: asyncio.Event, http: uvicorn.Server) -> None:
    await stop.wait()
    http.should_exit = True


class EngineThread:
    """An engine built on a thread that lives as long as the engine does, and shut down there.

    The build blocks for tens of seconds (the engine's processes start, the model loads) while
    the port answers 503 "loading engine". The thread stays: an engine's processes may die with
    the thread that started them (SGLang's ask the kernel for SIGKILL when it ends,
    PR_SET_PDEATHSIG), so the build cannot run on a thread that returns.

    Args:
        name: the engine's name, in log lines.
        build: makes the engine (on the thread); the engine's `shutdown()` ends it.
        note_every: seconds between calls of `wait`'s `note`.
    """

    def __init__(self, name: str, build: Callable[[], Any], note_every: float) -> None:
        self.name = name
        self.note_every = note_every
        self.loop = asyncio.get_running_loop()
        self.built: asyncio.Future[Any] = self.loop.create_future()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build,), daemon=True, name=f"weightsync-{name}")
        self._thread.start()

    def _run(self, build: Callable[[], Any]) -> None:
        try:
            result: tuple[Any, BaseException | None] = (build(), None)
        except BaseException as exc:
            result = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped meanwhile
            self.loop.call_soon_threadsafe(_settle, self.built, *result)
        engine = result[0]
        if engine is None:
            return
        self._release.wait()
        started = time.monotonic()
        engine.shutdown()
        log.info("%s's engine shut down in %.1f s", self.name, time.monotonic() - started)

    async def wait(self, note: Callable[[], None], stop: asyncio.Task[None] | None) -> Any:
        """The engine once built; `note()` every `note_every` seconds meanwhile, as its processes
        start. None if `stop` ends first: the build goes on on its thread (a daemon), and fails
        once the caller has ended the engine's processes.

        Raises:
            Exception: whatever the build raised.
        """
        waits: set[asyncio.Future[Any]] = {self.built} if stop is None else {self.built, stop}
        while not self.built.done():
            await asyncio.wait(waits, timeout=self.note_every, return_when=asyncio.FIRST_COMPLETED)
            note()
            if stop is not None and stop.done() and not self.built.done():
                return None
        return self.built.result()

    def shutdown(self, timeout: float | None) -> None:
        """The engine's own shutdown, given `timeout` seconds (None: as long as it takes); a
        caller that bounds it ends what is left of the engine's processes."""
        self._release.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.info("%s's engine did not shut down within %.0f s: its processes are ended", self.name, timeout)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


NOTE_EVERY_S = 1.0
"""How often, while an engine's processes start, the shared memory they map is noted (`note`)."""

NOTE_SERVING_S = 5.0
"""How often, while the engine serves, what its processes map is noted again (SGLang makes a
segment a few seconds after it is up)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Port:
    """The port an engine adapter serves on: `front` answers (503s naming the start-up state
    until the adapter sets its app), `serving` runs until the server stops, `caught` lists the
    signals that stopped it."""

    front: Starting
    http: uvicorn.Server
    serving: asyncio.Task[None]
    caught: list[int]


async def serve_engine(
    name: str,
    config: ServeConfig,
    sock: Any,
    build: Callable[[], Any],
    run: Callable[[Any, Port, Callable[[Ready], None]], Awaitable[None]],
    options: ServeOptions,
) -> list[int]:
    """Serve `sock` until SIGTERM/SIGINT (or `options.stop`): 503 "loading engine" while
    `build()` makes engine `name` on its `EngineThread`, then `run(engine, port, ready)` until the
    port stops, then the engine's own shutdown. `note()` is called while the engine's processes
    start, once they serve (`ready`, which also announces), and before they stop. The engine's
    processes start with the shared token in their environment. Returns the signals caught.

    Raises:
        Exception: the engine could not be built, or `run` failed.
    """
    front = Starting()
    http = http_server(front, options.log_level)
    note = options.note
    with stopped_by_signals(http, options.stop) as caught, token_inherited(config.auth_token):
        port = Port(front, http, asyncio.create_task(http.serve(sockets=[sock])), caught)
        try:
            front.health = Health(False, "loading engine", f"loading the {config.engine} engine for {config.model}")
            owner = EngineThread(name, build, NOTE_EVERY_S)
            engine = await owner.wait(note, port.serving if options.shutdown_timeout is not None else None)
            if engine is None:  # stopped while the engine loaded
                return caught

            def ready(up: Ready) -> None:
                note()  # every engine process is up: the most they map
                options.announce(up)

            noting = asyncio.create_task(_note_every(note, NOTE_SERVING_S))
            try:
                if not port.serving.done():  # not stopped while the engine loaded
                    await run(engine, port, ready)
            finally:
                noting.cancel()
                note()  # what the engine's processes map, before they go
                owner.shutdown(options.shutdown_timeout)
        except BaseException as exc:
            front.health = Health(False, "failed", f"the server could not start: {exc}")
            raise
        finally:
            http.should_exit = True
            with contextlib.suppress(BaseException):
                await port.serving
    return caught


async def _note_every(note: Callable[[], None], seconds: float) -> None:
    """`note()` every `seconds`, on a thread: reading an engine's process maps must not hold up
    the port's answers."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await asyncio.to_thread(note)
        except Exception as exc:  # a process that ended mid-read: the next note sees the rest
            log.debug("noting the engine's footprint failed: %s", exc)
