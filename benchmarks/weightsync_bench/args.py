"""`weightsync-bench`'s arguments (`build_parser`); cli.py runs what they ask for."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from weightsync.cli.args import DefaultsFormatter, at_least, positive_seconds

if TYPE_CHECKING:
    from weightsync_bench.link import Link

__all__ = ["DEFAULT_SIZE_GB", "build_parser"]

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
    from weightsync_bench import DEFAULT_TRANSPORTS, TRANSPORTS

    if text == "all":
        return DEFAULT_TRANSPORTS
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in TRANSPORTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected 'all' or a comma list of {', '.join(TRANSPORTS)}, got {text!r}")
    return names


def link(text: str) -> Link:
    from weightsync.errors import ConfigError
    from weightsync_bench.link import Link

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


def build_parser() -> argparse.ArgumentParser:
    """The `weightsync-bench` command's parser (`python -m weightsync_bench` is the same)."""
    bench = argparse.ArgumentParser(
        prog="weightsync-bench",
        formatter_class=DefaultsFormatter,
        description="Push a synthetic bf16 model through each transport to receivers in other processes, "
        "verify every byte, and compare with memcpy and torch.save / safetensors / multiprocessing baselines.",
    )
    bench.add_argument("--traceback", action="store_true", help="on an error, show its traceback instead of one line")
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
    return bench
