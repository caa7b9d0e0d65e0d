"""`weightsync serve --engine sglang`: SGLang's own server, with weightsync's parts on top.

How it is put together (the vLLM adapter's shape, with SGLang's doors; what the two share is
own_server.py):

1. SGLang's arguments are parsed by SGLang's own `prepare_server_args` (launch.py), from
   weightsync's flags plus anything given with --engine-args: every `sglang serve` option
   works, with SGLang's defaults, and weightsync's loader as its `--custom-weight-loader`.
2. The engine is SGLang's `Engine` (the tokenizer manager in this process, the scheduler and
   detokenizer in SGLang's own processes), built on a thread: the port answers 503 "loading
   engine" meanwhile instead of hanging.
3. The app is SGLang's own FastAPI app, set up as SGLang's `launch_server` sets it up: every
   route, handler, chat template and sampling parameter is SGLang's own code.
4. Every TP worker runs weightsync's receiver, started through SGLang's custom-loader door
   (`update_weights_from_tensor` carrying the worker kit's `Start` message); the workers tell this
   process their addresses through a rendezvous store it hosts for that call, and ring its
   doorbell as a push reaches them: this process then runs the round on every worker through
   the sync control (control.py): SGLang's `pause_generation`, `begin_weight_update`, a `Land`
   message through the loader door, `end_weight_update`, `update_weight_version`,
   `continue_generation`.
5. weightsync adds its routes and its middleware (http.py, labels.py): /health, /weight_info,
   /pause, /resume, /metrics, the gate, bearer auth, weight versions on OpenAI responses; and
   refuses SGLang's own weight and pause routes (`Owned`): the sync control owns the weights,
   and an update behind its back would serve a version nobody labelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any

from weightsync.integrations.sglang.control import Land, payload
from weightsync.integrations.sglang.trainer import LOADER
from weightsync.serving import own_server
from weightsync.serving.config import PauseMode, ServeConfig
from weightsync.serving.error_body import error
from weightsync.serving.foreground import Port, Ready, ServeOptions, serve_engine, stopped_by_signals
from weightsync.serving.metrics import ServerMetrics
from weightsync.serving.sglang.launch import build_engine, serve_app, sglang_args, warm_up
from weightsync.serving.sglang.launch import preload as preload_sglang
from weightsync.serving.sglang.versions import record_versions
from weightsync.workers.start import Start

__all__ = ["check", "preload", "serve"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
"""How often a "wait" pause checks whether the requests it waits for have finished."""

OWNED_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/init_weights_send_group_for_remote_instance",
        "/send_weights_to_remote_instance",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
    }
)
"""SGLang's routes that change the weights, their label or the pause: weightsync's own here."""


class Owned:
    """Refuses SGLang's routes in `OWNED_PATHS` with a 403 naming weightsync's way instead,
    outside the HTTP face: the same answer with or without the token, before or after the first
    sync."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in OWNED_PATHS:
            response = error(
                403,
                f"{scope['path']} is not served here: weightsync owns this server's weights "
                "(push with weightsync; pause with POST /pause and /resume)",
                None,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Engine:
    """SGLang's tokenizer manager as the server calls it (`own_server.WorkerEngine`)."""

    name = "SGLang"

    def __init__(self, manager: Any, tp_size: int, timeout: float) -> None:
        self.manager = manager
        self.session = ""
        """The rendezvous session the workers' receivers were started in (`start_workers`)."""
        self.num_workers = tp_size
        self.timeout = timeout
        self.died = ""
        """Why SGLang's engine is gone for good ("" while it runs): one of its processes failed."""
        self.admitting = asyncio.Event()
        self.admitting.set()
        self._epoch = 0
        """Counts resumes: a "wait" pause still draining when generation resumed pauses nothing."""

    @property
    def errored(self) -> bool:
        return bool(self.died)

    def failure(self) -> str:
        return f"SGLang's engine died ({self.died}); restart the server" if self.died else ""

    async def pause_generation(self, *, mode: PauseMode) -> None:
        """SGLang's pause: "abort" is its own; "wait" admits no new request, lets every running
        one finish, then pauses (nothing is held, so SGLang can flush its prefix cache at the
        update); "keep" holds running requests in place (SGLang's "in_place": a sync then fails
        and leaves the server not ready, as SGLang cannot flush a cache that requests hold, so
        `check` refuses it as the sync mode)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        epoch = self._epoch
        if mode == "wait":
            self.admitting.clear()  # new requests wait here; once paused, in SGLang's tokenizer manager
            try:
                while self.manager.rid_to_state and not self.died:
                    await asyncio.sleep(DRAIN_POLL_S)
            finally:
                self.admitting.set()
        if epoch != self._epoch:  # resumed while it drained
            return
        await self.manager.pause_generation(PauseGenerationReqInput(mode="abort" if mode == "abort" else "in_place"))

    async def resume_generation(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._epoch += 1
        await self.manager.continue_generation(ContinueGenerationReqInput())

    def admit(self, generate: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        """SGLang's `generate_request`, holding a new request while a "wait" pause drains."""

        @functools.wraps(generate)
        async def admitted(obj: Any, request: Any = None) -> AsyncIterator[Any]:
            await self.admitting.wait()
            async for output in generate(obj, request):
                yield output

        return admitted

    async def start_weight_update(self) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        _succeeded(await self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector="all")), "begin")

    async def update_weights(self, version: int) -> None:
        """Every TP worker lands `version` from its receiver (the `Land` message through
        SGLang's loader door); each tells the control how it went through the doorbell."""
        land = Land(version=version, session=self.session, timeout=self.timeout)
        await self._load(land)

    async def finish_weight_update(self, version: int | None) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        _succeeded(await self.manager.end_weight_update(EndWeightUpdateReqInput()), "end")
        if version is not None:
            await self.label(version)

    async def label(self, version: int) -> None:
        """Name the weights served `version` (SGLang's `update_weight_version`; generation is
        paused, or not started: no request is running to abort)."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        request = UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
        await self.manager.update_weight_version(request)

    async def serve_lora(self, name: str, lora_id: int, path: str) -> None:
        raise NotImplementedError("weightsync serve --engine sglang serves no LoRA adapters")

    async def remove_lora(self, lora_id: int) -> None:
        raise NotImplementedError("weightsync serve --engine sglang serves no LoRA adapters")

    async def start_workers(self, start: Start) -> None:
        """Every TP worker starts its receiver (`Start` through the loader door), in an update
        session of its own."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        self.session = start.session
        _succeeded(await self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector="all")), "begin")
        try:
            await self._load(start)
        finally:
            _succeeded(await self.manager.end_weight_update(EndWeightUpdateReqInput()), "end")

    async def stop_workers(self) -> None:
        """Nothing to close here: SGLang's own shutdown ends its workers and their receivers."""

    async def _load(self, message: Start | Land) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload(message, self.num_workers), load_format=LOADER, flush_cache=True
        )
        _succeeded(await self.manager.update_weights_from_tensor(request, None), "update_weights_from_tensor")


def _succeeded(answer: Any, call: str) -> None:
    """SGLang's (success, message) answer, or raise with its message."""
    success, message = answer[0], answer[1]
    if not success:
        raise RuntimeError(f"SGLang's {call} failed: {message}")


def check(config: ServeConfig, extra_args: Sequence[str] = ()) -> None:
    """Raises ConfigError when SGLang's own parser refuses the arguments."""
    sglang_args(config, 0, extra_args)


def preload(config: ServeConfig) -> None:
    """Imports before the port listens (launch.py)."""
    preload_sglang()


async def serve(config: ServeConfig, sock: socket.socket, options: ServeOptions) -> list[int]:
    """The adapter's `serve` (engines.EngineAdapter): SGLang's own server, ready once every
    worker's receiver is."""
    args = sglang_args(config, int(sock.getsockname()[1]), options.extra_args)

    async def run(engine: Any, port: Port, ready: Callable[[Ready], None]) -> None:
        sglang = _Engine(engine.tokenizer_manager, engine.server_args.tp_size, config.receiver.timeout)
        # SGLang's tokenizer manager takes SIGTERM and SIGQUIT on this loop; take them back
        engine.tokenizer_manager.auto_create_handle_loop()
        with _signals_kept(port, sglang):
            manager = engine.tokenizer_manager
            await warm_up(manager, config.model)
            manager.generate_request = sglang.admit(manager.generate_request)
            record_versions(manager)
            # SGLang's weight routes are refused whoever asks, whenever
            await own_server.run(config, sglang, serve_app(engine), port, ready, metrics=ServerMetrics(), outer=Owned)

    return await serve_engine("SGLang", config, sock, functools.partial(build_engine, args), run, options)


@contextlib.contextmanager
def _signals_kept(port: Port, engine: _Engine) -> Iterator[None]:
    """SGLang's tokenizer manager takes SIGTERM and SIGQUIT for itself on its first use (SIGTERM
    drains and ends the process tree; SIGQUIT, a child's failure, kills it). Take them back:
    SIGTERM and SIGINT stop the server as for every engine (foreground.py), and a SIGQUIT marks
    the engine dead (503s naming it, syncs refused) until the server is restarted."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: SGLang installed nothing
        loop.add_signal_handler(signal.SIGQUIT, _died, engine)
    with stopped_by_signals(port.http) as ours:
        try:
            yield
        finally:
            port.caught.extend(ours)


def _died(engine: _Engine) -> None:
    engine.died = "one of its processes failed (SIGQUIT)"
    log.error("SGLang's engine died: one of its processes failed; restart the server")
