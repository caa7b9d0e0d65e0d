"""What SGLang is given and built from, for `weightsync serve --engine sglang`.

sglang_args   SGLang's full server arguments, parsed by SGLang's own `prepare_server_args`
preload       imports before the port listens
build_engine  SGLang's `Engine` (tokenizer manager here; scheduler and detokenizer processes),
              as its own server builds it (called on a thread)
serve_app     SGLang's own FastAPI app, set up as its `launch_server` sets it up
warm_up       one token generated before serving
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from collections.abc import Sequence
from typing import Any

from weightsync.errors import ConfigError
from weightsync.integrations.sglang.trainer import LOADER
from weightsync.serving.config import ServeConfig, model_dtype

__all__ = ["build_engine", "on_cpu", "preload", "serve_app", "sglang_args", "warm_up"]

log = logging.getLogger(__name__)

CPU_KV_TOKENS = 4096
"""KV cache tokens SGLang reserves on a CPU unless told otherwise (by default it takes 0.7 of
the host's free memory)."""

OWNED_FLAGS = frozenset(
    {"--custom-weight-loader", "--port", "--api-key", "--admin-api-key", "--dp-size", "--dp", "--skip-server-warmup"}
)
"""SGLang flags weightsync sets itself under `weightsync serve`, refused in --engine-args."""

WARM_UP_TIMEOUT_S = 300.0
"""Seconds the one-token warm-up generation may take (a first forward on a busy CPU is slow)."""


def on_cpu() -> bool:
    """Whether SGLang runs on the CPU here (no CUDA device): its CPU platform, which SGLang
    selects from $SGLANG_USE_CPU_ENGINE, read when its runtime is imported."""
    import torch

    return not torch.cuda.is_available()


def _cpu_platform() -> None:
    if on_cpu():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def sglang_args(config: ServeConfig, port: int, extra: Sequence[str] = ()) -> Any:
    """SGLang's `ServerArgs`: weightsync's settings, then `extra` (later flags win), parsed and
    checked by SGLang's own parser. `port` is the port this server listens on.

    Raises:
        ConfigError: SGLang refused the arguments, or they take what weightsync owns.
    """
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    owned = sorted(given & OWNED_FLAGS)
    if owned:
        raise ConfigError(f"{owned[0]} is weightsync's own under weightsync serve (docs/integrations/sglang.md)")
    if config.sync_mode == "keep":
        raise ConfigError(
            "--sync-mode keep: SGLang cannot flush its prefix cache while requests are held in place "
            "across a sync; use wait (the default) or abort"
        )
    if config.max_lora_rank:
        raise ConfigError(
            "--max-lora-rank: weightsync serve --engine sglang serves no LoRA adapters yet "
            "(docs/integrations/sglang.md); --engine vllm and hf do"
        )
    if config.chat_template is not None and "--chat-template" in given:
        raise ConfigError("give the chat template once: --chat-template, or in --engine-args")
    argv = ["--model-path", config.model, "--served-model-name", config.model_name]
    argv += ["--dtype", model_dtype(config.model), "--load-format", config.load_format]
    argv += ["--host", config.host, "--port", str(port), "--custom-weight-loader", LOADER, "--skip-server-warmup"]
    if config.chat_template is not None:
        argv += ["--chat-template", config.chat_template]
    if on_cpu():
        defaults = {"--device": "cpu", "--attention-backend": "torch_native", "--max-total-tokens": str(CPU_KV_TOKENS)}
        for flag, value in defaults.items():
            if flag not in given and not (flag == "--max-total-tokens" and "--mem-fraction-static" in given):
                argv += [flag, value]
    _cpu_platform()
    from sglang.srt.server_args import prepare_server_args

    try:
        return prepare_server_args([*argv, *extra])
    except SystemExit as exc:  # argparse's way of refusing: SGLang printed why
        raise ConfigError(f"SGLang refused the arguments {shlex.join(extra)!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"SGLang refused the arguments: {exc}") from exc


PRELOADED_MODULES = (
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.io_struct",
)
"""What building the engine and the app imports, imported by `preload` before the port listens."""


def preload() -> None:
    """Call before the port listens: import what the build imports on its thread (SGLang's
    imports take 15 s and more on a busy host, holding the interpreter meanwhile)."""
    import importlib

    _cpu_platform()
    for name in PRELOADED_MODULES:
        importlib.import_module(name)


def build_engine(server_args: Any) -> Any:
    """SGLang's `Engine` for `server_args`: the scheduler (one process per TP rank) and the
    detokenizer start, the tokenizer manager lives in this process. Blocks until the model is
    loaded (tens of seconds); run it on a thread."""
    from sglang.srt.entrypoints.engine import Engine

    return Engine(server_args=server_args)


def serve_app(engine: Any) -> Any:
    """SGLang's own FastAPI app (every route and handler SGLang's server has), set up for
    `engine` the way SGLang's `launch_server` sets it up, without its API-key middleware
    (weightsync's face authenticates) and without its warm-up request (`warm_up` runs one
    inside the process, past weightsync's gate)."""
    from sglang.srt.entrypoints import http_server

    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=engine.tokenizer_manager,
            template_manager=engine.template_manager,
            scheduler_info=engine._scheduler_init_result.scheduler_infos[0],
        )
    )
    app = http_server.app
    app.is_single_tokenizer_mode = True
    app.server_args = engine.server_args
    app.warmup_thread_kwargs = {"server_args": engine.server_args}
    return app


async def warm_up(manager: Any, model: str) -> None:
    """Generate one token from a one-token prompt before serving, on the weights SGLang starts
    with: a server that cannot run its model must refuse to start.

    Raises:
        ConfigError: SGLang could not generate the token.
    """
    from sglang.srt.managers.io_struct import GenerateReqInput

    why = f"the sglang engine cannot run {model}: a one-token warm-up generation"
    request = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        async with asyncio.timeout(WARM_UP_TIMEOUT_S):
            output = await manager.generate_request(request, None).__anext__()
    except Exception as exc:
        raise ConfigError(f"{why} failed: {type(exc).__name__}: {exc}") from exc
    if not output.get("output_ids"):
        raise ConfigError(f"{why} produced no token")
    log.info("warm-up: the sglang engine generated a token")
