"""`weightsync serve`: a rollout server that receives weight syncs.

weightsync serve --engine hf --model DIR --load-format dummy --port 8000 --transport shm --sync-mode wait
"""

from __future__ import annotations

import argparse

from weightsync.checksum import VERIFY_MODES
from weightsync.cli.args import add_auth_token, auth_token, port, seconds
from weightsync.cli.errors import Terminated
from weightsync.transports import serving_transports

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run a rollout server that receives weight syncs",
        description="Serve a model over an OpenAI-compatible API; weights arrive by `weightsync push` "
        "or a WeightSender, straight into the engine's memory.",
    )
    serve.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="inference engine (default hf)")
    serve.add_argument("--model", required=True, help="model directory (config.json, tokenizer, checkpoint)")
    serve.add_argument("--load-format", choices=("dummy", "auto"), default="dummy", help="dummy (default) or auto")
    serve.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the dir's name)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP interface (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="HTTP port, 0 for any free one (default 8000)")
    serve.add_argument(
        "--transport", choices=serving_transports(), default="shm", help="weight transport (default shm)"
    )
    serve.add_argument("--receiver-host", default="127.0.0.1", help="tcp receiver interface (default 127.0.0.1)")
    serve.add_argument("--receiver-port", type=port, default=0, help="tcp receiver port (default any)")
    serve.add_argument("--sync-mode", choices=("wait", "abort", "keep"), default="wait", help="pause mode for syncs")
    serve.add_argument("--ready-timeout", type=seconds, default=30.0, help="seconds a request waits for weights")
    serve.add_argument("--drain-timeout", type=seconds, default=60.0, help="seconds a sync waits for the loop")
    serve.add_argument("--sync-timeout", type=seconds, default=60.0, help="receiver timeout inside a sync")
    serve.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="off",
        help="the verification every push must use: bucket checksums, or full (also every tensor where it lands); default off",
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
    serve.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    serve.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from weightsync.server.app import create_app
    from weightsync.server.background import bind
    from weightsync.server.runtime import RolloutServer, ServeConfig, engine_class

    config = ServeConfig(
        model=args.model,
        engine=args.engine,
        load_format=args.load_format,
        transport=args.transport,
        receiver_host=args.receiver_host,
        receiver_port=args.receiver_port,
        sync_mode=args.sync_mode,
        ready_timeout=args.ready_timeout,
        drain_timeout=args.drain_timeout,
        sync_timeout=args.sync_timeout,
        served_model_name=args.served_model_name,
        verify=args.verify,
        auth_token=auth_token(args),
        allow_unauthenticated_generation=args.allow_unauthenticated_generation,
        host=args.host,
        staged=args.staged,
    )
    engine_class(config.engine)  # a missing engine fails here, before the port is taken and the model loaded
    sock = bind(args.host, args.port)
    try:
        server = RolloutServer(config)
    except BaseException:
        sock.close()
        raise
    try:
        host, bound_port = sock.getsockname()[:2]
        print(f"weightsync serve: http://{host}:{bound_port} receiver {server.receiver.address}", flush=True)
        http = uvicorn.Server(uvicorn.Config(create_app(server), log_level=args.log_level, lifespan="off"))
        http.run(sockets=[sock])
    except Terminated:  # SIGTERM is how a server is stopped: uvicorn has shut down cleanly
        pass
    finally:
        server.close()
        sock.close()
    return 0
