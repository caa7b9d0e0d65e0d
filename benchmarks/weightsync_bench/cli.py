"""The `weightsync-bench` command (`python -m weightsync_bench`): a configuration from the
parsed arguments (args.py), the run, then the table, or the JSON on stdout and the table on
stderr. Errors become one line on stderr and an exit status, as `weightsync`'s do."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from weightsync.cli import run_command
from weightsync_bench.args import DEFAULT_SIZE_GB, build_parser
from weightsync_bench.config import DEFAULT_TRANSPORTS, GIB, MIB

__all__ = ["main", "run"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `weightsync-bench`; returns the exit status (weightsync/cli/errors.py)."""
    parser = build_parser()
    parser.set_defaults(handler=run)
    return run_command(parser, argv)


def run(args: argparse.Namespace) -> int:
    from weightsync_bench import BenchConfig, fitting_size_bytes, format_table
    from weightsync_bench import run as run_bench

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
        transports=args.transport or DEFAULT_TRANSPORTS,
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
                f"weightsync-bench: {size_gb:g} GiB does not fit in the memory available now; measuring "
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
    from weightsync_bench.delta import format_delta_table, run_delta

    bucket = "auto" if args.bucket_mb is None else int(args.bucket_mb * MIB)
    results = run_delta(
        args.transport or DEFAULT_TRANSPORTS,
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
    from weightsync.errors import ConfigError
    from weightsync_bench.link import LINK_TRANSPORTS, crossover_gbit, format_link_table, run_links

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
        print("weightsync-bench: NIXL is not installed; measuring without nixl", file=sys.stderr)
        return tuple(name for name in transports if name != "nixl")
    return transports
