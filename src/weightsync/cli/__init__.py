"""The `weightsync` command: argument parsing only; each subcommand hands off to the library.

    weightsync demo [--mode disaggregated|colocated] [--servers 2] [--steps 80] [--out runs/demo]
    weightsync serve --engine vllm|hf --model DIR [--load-format dummy|auto] [--port P] [--transport shm|tcp|collective]
    weightsync push --model DIR --to URL [URL ...]
    weightsync digest [--to URL ...] [--model DIR] [--expect HEX]

One module per command (demo, serve, push, digest), each with `add_parser(subparsers)` and
`run(args) -> exit status`; args.py holds the shared argument types and reads
$WEIGHTSYNC_AUTH_TOKEN; errors.py maps every error to one line on stderr and an exit status.
`run_command` runs a parsed command under that mapping; the benchmarks' own command,
`weightsync-bench` (benchmarks/weightsync_bench), runs through it too.
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
from weightsync.cli import demo, digest, push, serve
from weightsync.cli.errors import TERMINATED, describe
from weightsync.serving.process import PARENT_FD_ENV, exit_with_parent, quiet_children

__all__ = ["build_parser", "main", "run_command"]

COMMANDS = (demo, serve, push, digest)


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
    return run_command(build_parser(), argv)


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` with `parser` (which has a --traceback flag) and run the `handler` it sets;
    any error becomes one line on stderr, named by the parser's prog and the subcommand, if
    any, and the exit status errors.py lists."""
    watch_parent()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    command = " ".join(filter(None, [parser.prog, getattr(args, "command", None)]))
    try:
        with sigterm_exits():
            return int(handler(args))
    except SystemExit as exc:
        if exc.code != TERMINATED or args.traceback:
            raise
        print(f"{command}: terminated", file=sys.stderr)
        return TERMINATED
    except (Exception, KeyboardInterrupt) as exc:
        if args.traceback:
            raise
        status, message = describe(exc, command)
        print(f"{command}: {message}", file=sys.stderr)
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
