"""`weightsync bench`: arguments, then the run (weightsync.bench), then the table or JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from weightsync.bench.link import Link
from weightsync.cli.args import DefaultsFormatter, at_least, positive_seconds

__all__ = ["add_parser", "run"]

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_SIZE_GB = 4.0


def positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def sink_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or set(names) - {"dict", "callable"}:
        raise argparse.ArgumentTypeError(f"expected dict, callable or dict,callable, got {text!r}")
    return names


def transport_names(text: str) -> tuple[str, ...]:
    from weightsync.bench import DEFAULT_TRANSPORTS, TRANSPORTS

    if text == "all":
        return DEFAULT_TRANSPORTS
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in TRANSPORTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected 'all' or a comma list of {', '.join(TRANSPORTS)}, got {text!r}")
    return names


def link(text: str) -> Link:
    from weightsync.errors import ConfigError

    try:
        return Link.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def counts(text: str) -> tuple[int, ...]:
    try:
        parsed = tuple(int(part) for part in text.split(","))
    except ValueError:
        parsed = ()
    if not parsed or min(parsed) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1 or 1,4, got {text!r}")
    return parsed


def bucket_mb(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'auto', got {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser(
        "bench",
        formatter_class=DefaultsFormatter,
        help="measure transfer speed against memcpy and the usual baselines",
        description="Push a synthetic bf16 model through each transport to receivers in other processes, "
        "verify every byte, and compare with memcpy and torch.save / safetensors / multiprocessing baselines.",
    )
    bench.add_argument(
        "--transport",
        type=transport_names,
        default=None,
        help="shm, tcp, collective, cudaipc (with --device cuda), nixl, a comma list, or all (= shm,tcp; the "
        "default; with --link: tcp,collective,nixl)",
    )
    bench.add_argument(
        "--sink",
        type=sink_names,
        default=("dict",),
        help="dict (destinations written in place; default), callable (an engine-style loader), or dict,callable",
    )
    bench.add_argument(
        "--size-gb",
        type=positive_gib,
        default=None,
        help=f"model size in GiB (default: {DEFAULT_SIZE_GB:g}, or the largest size that fits in the memory "
        "available now)",
    )
    bench.add_argument("--bucket-mb", type=bucket_mb, default=None, help="bucket size in MiB, or auto (default)")
    bench.add_argument("--receivers", type=counts, default=(1,), help="receiver counts, e.g. 1 or 1,4")
    bench.add_argument("--repeat", type=at_least(1), default=3, help="syncs per configuration")
    bench.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True, help="run the baselines")
    bench.add_argument("--num-slots", type=at_least(1), default=2, help="shared-memory ring slots")
    bench.add_argument("--verify", choices=("off", "bucket", "full"), default="off", help="checksums")
    bench.add_argument("--memcpy-mb", type=float, default=1024.0, help="memcpy reference buffer in MiB")
    bench.add_argument("--seed", type=int, default=0, help="content seed")
    bench.add_argument("--timeout", type=positive_seconds, default=120.0, help="seconds any step may take")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where source and destinations live")
    bench.add_argument(
        "--delta-lr",
        type=float,
        default=None,
        help="instead: delta against full sync of fp32 master weights stepped at this learning rate, sent as bf16",
    )
    bench.add_argument(
        "--steps",
        type=at_least(1),
        default=None,
        help="with --delta-lr or --link: steps per transport (5; 8 with --link)",
    )
    bench.add_argument(
        "--link",
        type=link,
        action="append",
        help="instead: delta and full pushes over a real link of this rate (10gbit, 500mbit, 10gbit,1ms: rate and "
        "one-way delay), in a private network namespace with its loopback shaped (root or user namespaces); "
        "repeat for several links. --delta-lr defaults to 1e-6",
    )
    bench.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 2 syncs, 256 MiB memcpy")
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout (table to stderr)")
    bench.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    bench.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weightsync.bench import BenchConfig, fitting_size_bytes, format_table
    from weightsync.bench import run as run_bench

    size_gb = DEFAULT_SIZE_GB if args.size_gb is None else args.size_gb
    if args.quick:
        size_gb, args.repeat, args.memcpy_mb = min(size_gb, 0.25), min(args.repeat, 2), 256.0
    if args.link:
        args.size_gb = size_gb
        return run_link_bench(args)
    if args.delta_lr is not None:
        args.size_gb = size_gb
        return run_delta_bench(args)
    config = BenchConfig(
        transports=args.transport or transport_names("all"),
        size_bytes=int(size_gb * GIB),
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
        sinks=args.sink,
    )
    if args.size_gb is None and not args.quick:  # the default: as large as fits, up to 4 GiB
        fits = fitting_size_bytes(config)
        if 0 < fits < config.size_bytes:
            print(
                f"weightsync bench: {size_gb:g} GiB does not fit in the memory available now; measuring "
                f"{fits / GIB:g} GiB (--size-gb sets it)",
                file=sys.stderr,
            )
            config = dataclasses.replace(config, size_bytes=fits)
    report = run_bench(config)
    table = format_table(report)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(report.to_json()))
    else:
        print(table)
    return 0 if all(result.verified for result in report.results) else 1


def run_delta_bench(args: argparse.Namespace) -> int:
    from weightsync.bench.delta import format_delta_table, run_delta

    bucket = "auto" if args.bucket_mb is None else int(args.bucket_mb * MIB)
    results = run_delta(
        args.transport or transport_names("all"),
        int(args.size_gb * GIB),
        args.delta_lr,
        args.steps or 5,
        args.seed,
        bucket,
        int(args.memcpy_mb * MIB),
    )
    table = format_delta_table(results)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps([dataclasses.asdict(result) for result in results]))
    else:
        print(table)
    return 0


def run_link_bench(args: argparse.Namespace) -> int:
    from weightsync.bench.link import LINK_TRANSPORTS, crossover_gbit, format_link_table, run_links
    from weightsync.errors import ConfigError

    transports = args.transport or _installed(LINK_TRANSPORTS)
    off_link = [name for name in transports if name not in LINK_TRANSPORTS]
    if off_link:
        raise ConfigError(
            f"--link measures transports that cross a network ({', '.join(LINK_TRANSPORTS)}), not {off_link[0]}"
        )
    results = run_links(
        args.link,
        transports,
        size_bytes=int(args.size_gb * GIB),
        lr=1e-6 if args.delta_lr is None else args.delta_lr,
        steps=args.steps or 8,
        seed=args.seed,
        bucket_bytes="auto" if args.bucket_mb is None else int(args.bucket_mb * MIB),
        memcpy_bytes=int(args.memcpy_mb * MIB),
        stream_bytes=min(int(args.size_gb * GIB), 512 * MIB),
        timeout=max(args.timeout, 3600.0),
    )
    table = format_link_table(results)
    if args.json:
        print(table, file=sys.stderr)
        crossover = {name: crossover_gbit(results, name) for name in transports}
        print(json.dumps({"links": [result.to_json() for result in results], "crossover_gbit": crossover}))
    else:
        print(table)
    return 0


def _installed(transports: tuple[str, ...]) -> tuple[str, ...]:
    """`transports` less nixl where NIXL is not installed (said on stderr)."""
    import importlib.util

    if "nixl" in transports and importlib.util.find_spec("nixl") is None:
        print("weightsync bench: NIXL is not installed; measuring without nixl", file=sys.stderr)
        return tuple(name for name in transports if name != "nixl")
    return transports
