"""The one error mapping of the `weightsync` command: any error -> one line on stderr and an exit
status, never a traceback (`weightsync --traceback COMMAND ...` shows it instead).

    2    usage: a bad flag (argparse) or a ConfigError (bad arguments or configuration)
    130  interrupted (Ctrl-C)
    143  terminated (SIGTERM; `weightsync serve` stops cleanly and exits 0: that is how a server is stopped)
    1    anything else: a server that refused or is not there, a failed sync, a missing package
"""

from __future__ import annotations

from weightsync.auth import TOKEN_ENV
from weightsync.errors import AuthError, ConfigError, ServerError, WeightSyncError, one_line

__all__ = ["FAILED", "INTERRUPTED", "TERMINATED", "USAGE", "describe"]

FAILED = 1
USAGE = 2
INTERRUPTED = 130
TERMINATED = 143
"""SIGTERM: the command's handler raises SystemExit(TERMINATED) in the main thread, so that every
`finally` runs (a parent stops its children) before the process exits."""


EXTRAS = {
    "weightsync serve": "server",
    "weightsync push": "server",
    "weightsync digest": "server",
    "weightsync demo": "demo",
    "weightsync-bench": "hf",
}
"""The pip extra each command's optional packages come with."""


def describe(exc: BaseException, command: str) -> tuple[int, str]:
    """The exit status and the one-line message for `exc`, raised by `command` (as typed:
    "weightsync push", "weightsync-bench")."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    if isinstance(exc, ConfigError):
        return USAGE, one_line(exc)
    if isinstance(exc, ImportError):
        return FAILED, missing_package(exc, command)
    if isinstance(exc, AuthError) or (isinstance(exc, ServerError) and exc.status in (401, 403)):  # refused the token
        return FAILED, f"{one_line(exc)} (give the servers' token with --auth-token or ${TOKEN_ENV})"
    if isinstance(exc, (WeightSyncError, OSError)):
        return FAILED, one_line(exc)
    program, _, subcommand = command.partition(" ")
    again = " ".join(filter(None, [program, "--traceback", subcommand]))
    return FAILED, f"unexpected {type(exc).__name__}: {one_line(exc)} ({again} ... shows where)"


def missing_package(exc: ImportError, command: str) -> str:
    root = (exc.name or "").partition(".")[0]
    if root == "vllm":
        return f"vLLM does not import here ({one_line(exc)}): run scripts/install-vllm.sh"
    extra = EXTRAS.get(command, "dev")
    return f"{one_line(exc)}: install what `{command}` needs from your weightsync checkout: pip install -e '.[{extra}]'"
