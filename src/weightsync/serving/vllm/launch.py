"""What vLLM is given and built from, for `weightsync serve --engine vllm`.

vllm_namespace   vLLM's full serve arguments, parsed by vLLM's own parser
preload          imports and a heap freeze before the port listens
build_async_llm  AsyncLLM, as vLLM's own server builds it (called on a thread)
warm_up          one token generated before serving
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.errors import ConfigError
from weightsync.integrations.vllm.plugin import BACKEND
from weightsync.serving.config import ServeConfig, model_dtype

__all__ = ["build_async_llm", "preload", "vllm_lora_rank", "vllm_namespace", "warm_up"]

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""KV cache vLLM reserves unless told otherwise (on CPU it would take most of RAM)."""

TRANSFER_CONFIG = json.dumps({"backend": BACKEND})
"""vLLM's `--weight-transfer-config`: weightsync's backend in every worker."""

WARM_UP_TIMEOUT_S = 300.0
"""Seconds the one-token warm-up generation may take (a first forward compiles kernels)."""


def vllm_namespace(config: ServeConfig, extra: Sequence[str] = ()) -> argparse.Namespace:
    """vLLM's full serve arguments: weightsync's settings, then `extra` (later flags win),
    parsed and checked by vLLM's own parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [
        "--model",
        config.model,
        "--served-model-name",
        config.model_name,
        "--load-format",
        config.load_format,
        "--dtype",
        model_dtype(config.model),
        "--weight-transfer-config",
        TRANSFER_CONFIG,
        "--host",
        config.host,
    ]
    given = " ".join(extra)
    if config.chat_template is not None:
        if "--chat-template" in given:
            raise ConfigError("give the chat template once: --chat-template, or in --engine-args")
        argv += ["--chat-template", config.chat_template]
    if "--enforce-eager" not in given and "compilation" not in given:
        argv.append("--enforce-eager")  # compiling takes minutes on CPU; opt in with --engine-args
    if config.max_lora_rank:
        # a request runs on the adapter version it started with: every resident version, and
        # one still draining, may be in one batch (--max-loras); the CPU cache holds a few more
        argv += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(config.max_lora_rank))]
        if "--max-loras" not in given:
            argv += ["--max-loras", str(config.lora_versions + 1)]
        if "--max-cpu-loras" not in given:
            argv += ["--max-cpu-loras", str(4 * config.lora_versions)]
    if "--kv-cache-memory-bytes" not in given and "--gpu-memory-utilization" not in given:
        argv += ["--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES)]
    parser = make_arg_parser(FlexibleArgumentParser(prog="weightsync serve --engine-args"))
    try:
        args = parser.parse_args([*argv, *extra])
        validate_parsed_serve_args(args)
    except SystemExit as exc:  # argparse's way of refusing: vLLM printed why
        raise ConfigError(f"vLLM refused the arguments {shlex.join(extra)!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refused the arguments: {exc}") from exc
    if getattr(args.weight_transfer_config, "backend", None) != BACKEND:
        raise ConfigError(f"--weight-transfer-config is weightsync's own (backend {BACKEND!r}: its receivers)")
    if args.data_parallel_size != 1:
        # One server labels one version for its workers; data parallel replicas are several
        # servers to a trainer (push to each).
        raise ConfigError(f"--data-parallel-size {args.data_parallel_size}: run one weightsync serve per replica")
    return args


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's --max-lora-rank accepts (vLLM 0.32's choices: it refuses any other)."""


def vllm_lora_rank(max_rank: int) -> int:
    """vLLM's --max-lora-rank for weightsync's `max_rank`: the smallest value vLLM accepts that
    holds it (its LoRA buffers are sized by it; the rank a push may have is still `max_rank`,
    checked by weightsync before a byte moves)."""
    return next((rank for rank in VLLM_LORA_RANKS if rank >= max_rank), max_rank)


PRELOADED_MODULES = (
    "vllm.engine.arg_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core_client",
    "vllm.entrypoints.launchers.app",
    "vllm.entrypoints.launchers.api_server.app_state",
    "vllm.v1.metrics.prometheus",
    "vllm.model_executor.model_loader",
)
"""What building the engine and the app imports, imported by `preload` before the port listens."""


def preload(model: str) -> None:
    """Call before the port listens: import what the engine build imports on its thread, and
    freeze the heap. Both would otherwise hold the interpreter for long stretches while the port
    answers 503 (imports; vLLM's full garbage collections, each scanning every object there is)."""
    import gc
    import importlib
    import importlib.metadata

    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    importlib.metadata.entry_points()  # vLLM scans them for plugins; cached from now on
    config = json.loads((Path(model) / "config.json").read_text())
    for architecture in config.get("architectures") or []:  # the model's module, as the build imports it
        from vllm.model_executor.models import ModelRegistry

        module = getattr(ModelRegistry.models.get(architecture), "module_name", None)
        with contextlib.suppress(Exception):  # an unsupported model fails in the build, with vLLM's reason
            importlib.import_module(module or "")
    gc.collect()
    gc.freeze()


def build_async_llm(args: argparse.Namespace) -> Any:
    """vLLM's AsyncLLM from serve arguments: the calls of vLLM's
    `build_async_engine_client_from_engine_args`, made here so they can run on a thread."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
    )


async def warm_up(engine: Any, model: str) -> None:
    """Generate one token from a one-token prompt before serving, on the weights vLLM starts with:
    a server that cannot run its model must refuse to start, not answer every request with
    nothing (vLLM's CPU backend, for one, starts on models its attention kernels cannot run).

    Raises:
        ConfigError: vLLM could not generate the token.
    """
    from vllm import SamplingParams

    why = f"the vllm engine cannot run {model}: a one-token warm-up generation"
    tokens: list[int] = []
    try:
        async with asyncio.timeout(WARM_UP_TIMEOUT_S):
            outputs = engine.generate({"prompt_token_ids": [0]}, SamplingParams(max_tokens=1), "weightsync-warm-up")
            async for output in outputs:
                tokens += output.outputs[0].token_ids
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(f"{why} failed: {type(cause).__name__}: {cause}") from exc
    if not tokens:
        raise ConfigError(f"{why} produced no token")
    log.info("warm-up: the vllm engine generated a token")
