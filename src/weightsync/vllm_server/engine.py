"""What vLLM is given and built from, for `weightsync serve --engine vllm`.

vllm_namespace   vLLM's full serve arguments, parsed by vLLM's own parser
preload          imports and a heap freeze before the port listens
build_engine     AsyncLLM, as vLLM's own server builds it (called on a thread)
warm_up          one token generated before serving
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.engines.vllm import DEFAULT_KV_CACHE_BYTES, VLLMEngine, config_dtype
from weightsync.errors import ConfigError
from weightsync.server.runtime import ServeConfig
from weightsync.vllm_server.worker import EXTENSION

__all__ = ["build_engine", "preload", "vllm_namespace", "warm_up"]

log = logging.getLogger(__name__)

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
        config_dtype(Path(config.model)),
        "--worker-extension-cls",
        EXTENSION,
        "--host",
        config.host,
    ]
    given = " ".join(extra)
    if "--enforce-eager" not in given and "compilation" not in given:
        argv.append("--enforce-eager")  # compiling takes minutes on CPU; opt in with --vllm-args
    if "--kv-cache-memory-bytes" not in given and "--gpu-memory-utilization" not in given:
        argv += ["--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES)]
    parser = make_arg_parser(FlexibleArgumentParser(prog="weightsync serve --vllm-args"))
    try:
        args = parser.parse_args([*argv, *extra])
        validate_parsed_serve_args(args)
    except SystemExit as exc:  # argparse's way of refusing: vLLM printed why
        raise ConfigError(f"vLLM refused the arguments {shlex.join(extra)!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM refused the arguments: {exc}") from exc
    if args.worker_extension_cls != EXTENSION:
        raise ConfigError("--worker-extension-cls is weightsync's own (its receiver lives there)")
    parallel = {"tensor": args.tensor_parallel_size, "pipeline": args.pipeline_parallel_size}
    parallel["data"] = args.data_parallel_size
    if any(size != 1 for size in parallel.values()):
        # Each worker would start its own receiver holding one shard, and one address is advertised.
        raise ConfigError(f"one vLLM worker per server for now; got parallel sizes {parallel}")
    return args


PRELOADED_MODULES = (
    "vllm.engine.arg_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core_client",
    "vllm.entrypoints.launchers.app",
    "vllm.entrypoints.launchers.api_server.app_state",
    "vllm.v1.metrics.prometheus",
)
"""What building the engine and the app imports, imported by `preload` before the port listens."""


def preload(model: str) -> None:
    """Call before the port listens: import what the engine build imports on its thread, and
    freeze the heap. Both would otherwise hold the interpreter for long stretches while the port
    answers 503 (imports; vLLM's full garbage collections, each scanning every object there is)."""
    import gc
    import importlib

    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    VLLMEngine.preload(model)  # vLLM's plugin scan and the model's own module
    gc.collect()
    gc.freeze()


def build_engine(args: argparse.Namespace) -> Any:
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
