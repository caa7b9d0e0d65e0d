"""`weightsync serve` and `weightsync push`: argument parsing, then hand-off to the library.

    weightsync serve --engine hf --model DIR --load-format dummy --port 8000 --transport shm --sync-mode wait
    weightsync push --model DIR --to http://127.0.0.1:8000 [URL ...] [--version N]

`weightsync.cli` registers both with `add_serve_parser` / `add_push_parser`; `python -m
weightsync.server.cli` runs them on their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from weightsync.checksum import VERIFY_MODES
from weightsync.errors import ConfigError, WeightSyncError

__all__ = ["add_digest_parser", "add_push_parser", "add_serve_parser", "main", "run_digest", "run_push", "run_serve"]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return int(text)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    serve.add_argument("--port", type=_port, default=8000, help="HTTP port, 0 for any free one (default 8000)")
    serve.add_argument(
        "--transport", choices=("shm", "tcp", "collective"), default="shm", help="weight transport (default shm)"
    )
    serve.add_argument("--receiver-host", default="127.0.0.1", help="tcp receiver interface (default 127.0.0.1)")
    serve.add_argument("--receiver-port", type=_port, default=0, help="tcp receiver port (default any)")
    serve.add_argument("--sync-mode", choices=("wait", "abort", "keep"), default="wait", help="pause mode for syncs")
    serve.add_argument("--ready-timeout", type=_seconds, default=30.0, help="seconds a request waits for weights")
    serve.add_argument("--drain-timeout", type=_seconds, default=60.0, help="seconds a sync waits for the loop")
    serve.add_argument("--sync-timeout", type=_seconds, default=60.0, help="receiver timeout inside a sync")
    serve.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="off",
        help="the verification every push must use: bucket checksums, or full (also every tensor where it lands); default off",
    )
    serve.add_argument(
        "--auth-token",
        default=None,
        help="shared secret for pushes (HMAC) and control endpoints (Bearer); default $WEIGHTSYNC_AUTH_TOKEN; "
        "required to listen beyond loopback",
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
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from weightsync.server.app import create_app
    from weightsync.server.background import bind
    from weightsync.server.runtime import RolloutServer, ServeConfig

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
        auth_token=args.auth_token,
        allow_unauthenticated_generation=args.allow_unauthenticated_generation,
        host=args.host,
        staged=args.staged,
    )
    sock = bind(args.host, args.port)
    server = RolloutServer(config)
    try:
        host, port = sock.getsockname()[:2]
        print(f"weightsync serve: http://{host}:{port} receiver {server.receiver.address}", flush=True)
        http = uvicorn.Server(uvicorn.Config(create_app(server), log_level=args.log_level, lifespan="off"))
        http.run(sockets=[sock])
    finally:
        server.close()
        sock.close()
    return 0


def add_push_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    push = subparsers.add_parser(
        "push",
        help="push a safetensors checkpoint to running servers",
        description="Read DIR's safetensors checkpoint one tensor at a time and push it to every server.",
    )
    push.add_argument("--model", required=True, help="model directory with *.safetensors")
    push.add_argument("--to", nargs="+", required=True, metavar="URL", help="server URLs (http://HOST:PORT)")
    push.add_argument("--version", type=int, default=None, help="weight version (default: highest served + 1)")
    push.add_argument("--timeout", type=_seconds, default=60.0, help="seconds any wait may last (default 60)")
    push.add_argument("--verify", choices=VERIFY_MODES, default="off", help="bucket or full checksums (default off)")
    push.add_argument("--auth-token", default=None, help="the servers' shared secret (default $WEIGHTSYNC_AUTH_TOKEN)")
    push.add_argument("--json", action="store_true", help="print the report as JSON")
    push.set_defaults(handler=run_push)


def run_push(args: argparse.Namespace) -> int:
    from weightsync.checkpoint import SafetensorsSource
    from weightsync.sender import WeightSender
    from weightsync.server.client import RolloutClient

    if args.version is not None and args.version < 0:
        raise ConfigError(f"--version must be a non-negative integer, got {args.version}")
    infos = []
    for url in args.to:
        with RolloutClient(url, timeout=args.timeout, auth_token=args.auth_token) as client:
            infos.append(client.weight_info())
    addresses = [address for info in infos for address in info["addresses"]]
    version = args.version
    if version is None:
        version = max((info["version"] for info in infos if info["version"] is not None), default=0) + 1
    source = SafetensorsSource(args.model)
    with WeightSender(addresses, timeout=args.timeout, verify=args.verify, auth_token=args.auth_token) as sender:
        report = sender.push(source, version)
    if args.json:
        print(json.dumps(_report_json(report, args.to, addresses)))
    else:
        print(
            f"version {report.version}: {report.total_bytes} bytes, {report.num_tensors} tensors in "
            f"{report.seconds:.3f} s ({report.gbps:.2f} GB/s)"
        )
        for url, outcome in zip(args.to, report.outcomes, strict=False):
            status = "committed" if outcome.committed else f"FAILED {outcome.kind}: {outcome.error}"
            print(f"  {url} ({outcome.address}): {status}")
    return 0 if report.ok else 1


def _report_json(report, urls, addresses):  # type: ignore[no-untyped-def]
    by_address = dict(zip(addresses, urls, strict=False))
    return {
        "version": report.version,
        "bytes": report.total_bytes,
        "num_tensors": report.num_tensors,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "ok": report.ok,
        "content_digest": report.content_digest,
        "outcomes": [
            {
                "url": by_address.get(o.address),
                "address": o.address,
                "committed": o.committed,
                "kind": o.kind,
                "error": o.error,
            }
            for o in report.outcomes
        ],
    }


def add_digest_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    digest = subparsers.add_parser(
        "digest",
        help="check the content digest servers hold against each other, a checkpoint or a value",
        description="Read each server's content digest (from its last verified push) and compare. With "
        "--model, the expected digest is computed from that checkpoint as a push would send it "
        "(whatever its bucket size). Exit status 0 only "
        "if every server holds the expected digest (without one, the same digest as the others).",
    )
    digest.add_argument("--to", nargs="*", default=[], metavar="URL", help="server URLs (http://HOST:PORT)")
    digest.add_argument("--model", default=None, help="checkpoint directory (*.safetensors) to compute it from")
    digest.add_argument("--expect", default=None, metavar="HEX", help="the digest a push reported")
    digest.add_argument("--timeout", type=_seconds, default=60.0, help="seconds for each HTTP call (default 60)")
    digest.add_argument(
        "--auth-token", default=None, help="the servers' shared secret (default $WEIGHTSYNC_AUTH_TOKEN)"
    )
    digest.add_argument("--json", action="store_true", help="print the result as JSON")
    digest.set_defaults(handler=run_digest)


def run_digest(args: argparse.Namespace) -> int:
    from weightsync.checkpoint import SafetensorsSource
    from weightsync.digest import source_digest
    from weightsync.server.client import RolloutClient

    if not args.to and not args.model:
        raise ConfigError("give --to URL ... (what servers hold), --model DIR (what a push would send), or both")
    held = {}
    for url in args.to:
        with RolloutClient(url, timeout=args.timeout, auth_token=args.auth_token) as client:
            info = client.weight_info()
        held[url] = {"version": info["version"], "content_digest": info["content_digest"]}
    expected = args.expect
    if args.model:
        computed = source_digest(SafetensorsSource(args.model))
        if expected is not None and expected != computed:
            raise ConfigError(f"--expect {expected} contradicts the checkpoint's digest {computed}")
        expected = computed
    if expected is None and held:
        expected = next(iter(held.values()))["content_digest"] or None
    ok = all(entry["content_digest"] and entry["content_digest"] == expected for entry in held.values())
    if args.json:
        print(json.dumps({"expected": expected, "ok": ok, "servers": held}))
    else:
        if expected is not None:
            print(f"expected {expected}")
        for url, entry in held.items():
            digest = entry["content_digest"]
            verdict = (
                "match"
                if digest and digest == expected
                else "no digest (push with --verify)"
                if not digest
                else "MISMATCH"
            )
            print(f"  {url}: version {entry['version']} {digest or '-'} {verdict}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m weightsync.server.cli serve|push ...` (the same as `weightsync serve|push`)."""
    parser = argparse.ArgumentParser(prog="weightsync")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(subparsers)
    add_push_parser(subparsers)
    add_digest_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"weightsync {args.command}: {exc}", file=sys.stderr)
        return 2
    except WeightSyncError as exc:
        print(f"weightsync {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
