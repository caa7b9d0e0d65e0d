"""The `weightsync` command: argument parsing only; each subcommand hands off to the library.

    weightsync demo [--mode disaggregated|colocated] [--servers 2] [--steps 80] [--out runs/demo]
    weightsync bench [--transport shm,tcp] [--size-gb 4] [--bucket-mb auto] [--receivers 1,4] [--json]
    weightsync serve --engine vllm|hf --model DIR [--load-format dummy|auto] [--port P] [--transport shm|tcp|collective]
    weightsync push --model DIR --to URL [URL ...]
    weightsync digest [--to URL ...] [--model DIR] [--expect HEX]

One module per command (demo, bench, serve, push, digest), each with `add_parser(subparsers)` and
`run(args) -> exit status`; args.py holds the shared argument types and reads
$WEIGHTSYNC_AUTH_TOKEN; errors.py maps every error to one line on stderr and an exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from weightsync import __version__
from weightsync.cli import bench, demo, digest, push, serve
from weightsync.cli.errors import TERMINATED, describe
from weightsync.serving.process import PARENT_FD_ENV, exit_with_parent, quiet_children

__all__ = ["build_parser", "main"]

COMMANDS = (demo, bench, serve, push, digest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description="Move model weights from trainer to engines.")
    parser.add_argument("--traceback", action="store_true", help="on an error, show its traceback instead of one line")
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `weightsync` command; returns the exit status (errors.py lists them)."""
    watch_parent()
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        with sigterm_exits():
            return int(handler(args))
    except SystemExit as exc:
        if exc.code != TERMINATED or args.traceback:
            raise
        print(f"weightsync {args.command}: terminated", file=sys.stderr)
        return TERMINATED
    except (Exception, KeyboardInterrupt) as exc:
        if args.traceback:
            raise
        status, message = describe(exc, args.command)
        print(f"weightsync {args.command}: {message}", file=sys.stderr)
        return status


def watch_parent() -> None:
    """A child started by `ChildProcess` stops when its parent dies (serving/process.py). The
    variable is removed so that this process's own children do not watch a stale number."""
    fd = os.environ.pop(PARENT_FD_ENV, "")
    if fd.isdigit():
        exit_with_parent(int(fd))


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread, so cleanup runs (children stopped, shared
    memory released) before the process exits; SIGTERM and Ctrl-C also quiet the children's
    stderr (`quiet_children`). The previous handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        quiet_children()
        raise SystemExit(TERMINATED)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        quiet_children()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    # Ctrl-C as Python's default, unless SIGINT is ignored (a shell's background job)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous_int)
