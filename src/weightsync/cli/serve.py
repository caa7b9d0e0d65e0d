"""`weightsync serve`: a rollout server that receives weight syncs.

weightsync serve --engine hf --model DIR --load-format dummy --port 8000 --transport shm --sync-mode wait
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from typing import TYPE_CHECKING

from weightsync.checksum import VERIFY_MODES
from weightsync.cli.args import DefaultsFormatter, add_auth_token, at_least, auth_token, port, seconds
from weightsync.cli.errors import TERMINATED
from weightsync.serving.engines import ENGINES
from weightsync.transports import serving_transports

if TYPE_CHECKING:
    from weightsync.serving.footprint import Footprint

__all__ = ["add_parser", "run"]

log = logging.getLogger("weightsync.serve")

ENGINE_SHUTDOWN_S = 3.0
"""Seconds `weightsync serve` gives the engine's own shutdown (vLLM's workers' exit, its engine
core's) before it ends whatever is left of the engine's processes: vLLM alone may wait 5 s, then
4 more."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve",
        formatter_class=DefaultsFormatter,
        help="run a rollout server that receives weight syncs",
        description="Serve a model over an OpenAI-compatible API; weights arrive by `weightsync push` "
        "or a WeightSender, straight into the engine's memory.",
    )
    serve.add_argument("--engine", choices=tuple(ENGINES), default="hf", help="inference engine")
    serve.add_argument("--model", required=True, help="model directory (config.json, tokenizer, checkpoint)")
    serve.add_argument("--load-format", choices=("dummy", "auto"), default="dummy", help="dummy (default) or auto")
    serve.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the dir's name)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP interface")
    serve.add_argument("--port", type=port, default=8000, help="HTTP port, 0 for any free one")
    serve.add_argument("--transport", choices=serving_transports(), default="shm", help="weight transport")
    serve.add_argument("--receiver-host", default="127.0.0.1", help="tcp receiver interface")
    serve.add_argument("--receiver-port", type=port, default=0, help="tcp receiver port (default any)")
    serve.add_argument("--sync-mode", choices=("wait", "abort", "keep"), default="wait", help="pause mode for syncs")
    serve.add_argument(
        "--ready-timeout",
        type=seconds,
        default=8.0,
        help="seconds a request waits for weights before its 503 (which carries Retry-After)",
    )
    serve.add_argument("--drain-timeout", type=seconds, default=60.0, help="seconds a sync waits for the loop")
    serve.add_argument("--sync-timeout", type=seconds, default=60.0, help="receiver timeout inside a sync")
    serve.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="off",
        help="the verification every push must use: bucket checksums, or full (also every tensor where it lands)",
    )
    add_auth_token(
        serve,
        "shared secret for pushes (HMAC) and control endpoints (Bearer); required to listen beyond loopback",
    )
    serve.add_argument(
        "--allow-unauthenticated-generation",
        action="store_true",
        help="serve /v1/completions and /v1/models without the token",
    )
    serve.add_argument(
        "--staged",
        action="store_true",
        help="land syncs in a standby copy, made live only at commit: a failed sync never touches the "
        "served weights, and the engine serves during the transfer (one more copy of the weights in memory)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=at_least(1024),
        default=None,
        help="largest request body, refused before it is parsed (default: 256 bytes per token of the "
        "model's context, at least 1 MiB)",
    )
    serve.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template for /v1/chat/completions, instead of the tokenizer's (default: the "
        "tokenizer's; a model without one is named at start-up)",
    )
    serve.add_argument(
        "--max-lora-rank",
        type=at_least(0),
        default=0,
        metavar="N",
        help="serve LoRA adapters pushed to this server (in memory, by their name), of rank up to N "
        "(default: 0, adapters are refused)",
    )
    serve.add_argument(
        "--lora-versions",
        type=at_least(1),
        default=2,
        metavar="K",
        help="versions of each LoRA adapter kept resident",
    )
    serve.add_argument(
        "--engine-args",
        "--vllm-args",
        default="",
        help="more arguments for the engine, as one string: `vllm serve` arguments for --engine vllm (e.g. "
        '"--max-model-len 4096 --enable-auto-tool-choice --tool-call-parser hermes"), which vLLM\'s own parser reads',
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="log level: info (default) logs start-up, every sync and every refused push; debug adds "
        "every HTTP request",
    )
    serve.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; whatever way it stops (SIGTERM, SIGINT, an error, its parent gone),
    what the server and its engine made on the host goes with it (serving/footprint.py). SIGTERM
    at any point exits 0: that is how a server is stopped."""
    from weightsync.serving.footprint import Footprint
    from weightsync.serving.process import on_hard_exit

    try:
        with Footprint() as footprint:  # first: the engine's temporary files go to its folder
            on_hard_exit(footprint.close)
            return run_server(args, footprint)
    except SystemExit as exc:
        # SIGTERM is how a server is stopped, whenever it comes: during the engine's imports
        # (seconds to a minute on a busy host) as well as while it serves. It stopped cleanly.
        if exc.code != TERMINATED:
            raise
        return 0


def run_server(args: argparse.Namespace, footprint: Footprint) -> int:
    """Check, preload, bind, then serve with the engine's adapter until stopped."""
    import asyncio
    import shlex

    from weightsync.options import ReceiverOptions
    from weightsync.serving.background import bind
    from weightsync.serving.config import ServeConfig
    from weightsync.serving.engines import engine_adapter
    from weightsync.serving.foreground import Ready, ServeOptions

    # every field of ServeConfig but the receiver's is the flag of its name
    flags = {
        field.name: getattr(args, field.name) for field in dataclasses.fields(ServeConfig) if field.name != "receiver"
    }
    config = ServeConfig(
        **(flags | {"auth_token": auth_token(args)}),
        receiver=ReceiverOptions(
            host=args.receiver_host, port=args.receiver_port, timeout=args.sync_timeout, verify=args.verify
        ),
    )
    if config.engine == "vllm":
        from weightsync.serving.vllm.noise import quiet_vllm

        quiet_vllm()  # before vLLM's first import: its dependencies' noise stays off the terminal
    adapter = engine_adapter(config.engine)  # a missing engine fails here, before the port is taken
    from weightsync.serving import watchdog

    # An engine's worker processes are our descendants (vLLM's engine core and worker are our
    # grandchildren): should this process be killed (SIGKILL, the OOM killer), the watchdog ends
    # them and removes their shared memory. Our own stop ends it (a descendant: footprint.close).
    watchdog.start(footprint.folder)
    extra = shlex.split(args.engine_args)
    adapter.check(config, extra)  # so does a refusal of the engine's arguments
    # The engine's imports now, so that the engine builds on a thread after them and the API
    # answers within milliseconds all along.
    adapter.preload(config)
    configure_logging(args.log_level)
    sock = bind(args.host, args.port)
    host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{bound_port}"

    def announce(ready: Ready) -> None:
        print(f"weightsync serve: {url} receiver {','.join(ready.addresses)}", flush=True)

    try:
        log.info("listening on %s (503 until the %s engine is up)", url, args.engine)
        caught = asyncio.run(
            adapter.serve(
                config,
                sock,
                ServeOptions(
                    extra,
                    announce,
                    args.log_level,
                    note=footprint.note,
                    shutdown_timeout=ENGINE_SHUTDOWN_S,  # then the footprint ends what is left of the engine
                ),
            )
        )
    finally:
        sock.close()
    # What preload froze stays frozen: the interpreter's last collection at exit would scan it all
    # (5 s of a stop on the loaded 2-core dev machine, against 0.6 s), and the process ends here.
    if signal.SIGINT in caught:
        raise KeyboardInterrupt  # stopped cleanly; Ctrl-C's exit status, 130
    return 0


def configure_logging(level: str) -> None:
    """weightsync's own log lines (syncs, refused pushes, start-up) on stderr at `level`, set on
    weightsync's logger: an engine may set the root's later (vLLM's app, importing SageMaker's
    routes, sets it to ERROR, and no sync was logged)."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("weightsync").setLevel(level.upper())
