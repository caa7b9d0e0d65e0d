"""The `weightsync` command: argument parsing only; each subcommand hands off to the library.

weightsync demo [--mode disaggregated|colocated] [--servers 2] [--steps 80] [--out runs/demo]
weightsync bench [--transport shm,tcp] [--size-gb 4] [--bucket-mb auto] [--receivers 1,4] [--json]
weightsync serve --engine vllm|hf --model DIR [--load-format dummy|auto] [--port P] [--transport shm|tcp|collective]
weightsync push --model DIR --to URL [URL ...]
weightsync digest [--to URL ...] [--model DIR] [--expect HEX]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from weightsync.demo.cli import add_demo_parser
from weightsync.errors import ConfigError
from weightsync.server.cli import add_digest_parser, add_push_parser, add_serve_parser

__all__ = ["main"]

MIB = 1 << 20
GIB = 1 << 30


def _names(text: str) -> tuple[str, ...]:
    from weightsync.bench import DEFAULT_TRANSPORTS, TRANSPORTS

    if text == "all":
        return DEFAULT_TRANSPORTS
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in TRANSPORTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected 'all' or a comma list of {', '.join(TRANSPORTS)}, got {text!r}")
    return names


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1 or 1,4, got {text!r}")
    return counts


def _bucket_mb(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'auto', got {text!r}")
    return value


def _add_bench(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = subparsers.add_parser(
        "bench",
        help="measure transfer speed against memcpy and the usual baselines",
        description="Push a synthetic bf16 model through each transport to receivers in other processes, "
        "verify every byte, and compare with memcpy and torch.save / safetensors / multiprocessing baselines.",
    )
    bench.add_argument(
        "--transport",
        type=_names,
        default="all",
        help="shm, tcp, collective, cudaipc (with --device cuda), a comma list, or all (= shm,tcp; default)",
    )
    bench.add_argument("--size-gb", type=float, default=4.0, help="model size in GiB (default 4)")
    bench.add_argument("--bucket-mb", type=_bucket_mb, default=None, help="bucket size in MiB, or auto (default)")
    bench.add_argument("--receivers", type=_counts, default=(1,), help="receiver counts, e.g. 1 or 1,4 (default 1)")
    bench.add_argument("--repeat", type=int, default=3, help="syncs per configuration (default 3)")
    bench.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True, help="run the baselines")
    bench.add_argument("--num-slots", type=int, default=2, help="shared-memory ring slots (default 2)")
    bench.add_argument("--verify", choices=("off", "bucket", "full"), default="off", help="checksums (default off)")
    bench.add_argument("--memcpy-mb", type=float, default=1024.0, help="memcpy reference buffer in MiB (1024)")
    bench.add_argument("--seed", type=int, default=0, help="content seed")
    bench.add_argument("--timeout", type=float, default=120.0, help="seconds any step may take (default 120)")
    bench.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where source and destinations live (default cpu)"
    )
    bench.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 2 syncs, 256 MiB memcpy")
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout (table to stderr)")
    bench.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from weightsync.bench import BenchConfig, format_table, run

    if args.quick:
        args.size_gb, args.repeat, args.memcpy_mb = min(args.size_gb, 0.25), min(args.repeat, 2), 256.0
    config = BenchConfig(
        transports=args.transport if isinstance(args.transport, tuple) else _names(args.transport),
        size_bytes=int(args.size_gb * GIB),
        bucket_bytes=None if args.bucket_mb is None else int(args.bucket_mb * MIB),
        receivers=args.receivers,
        repeat=args.repeat,
        baselines=args.baselines,
        memcpy_bytes=int(args.memcpy_mb * MIB),
        num_slots=args.num_slots,
        verify=args.verify,
        seed=args.seed,
        timeout=args.timeout,
        progress=args.progress,
        device=args.device,
    )
    report = run(config)
    table = format_table(report)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(report.to_json()))
    else:
        print(table)
    return 0 if all(result.verified for result in report.results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description="Move model weights from trainer to engines.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(subparsers)
    _add_bench(subparsers)
    add_serve_parser(subparsers)
    add_push_parser(subparsers)
    add_digest_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `weightsync` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"weightsync {args.command}: {exc}", file=sys.stderr)
        return 2
