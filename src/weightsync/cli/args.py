"""Argument types the commands share, and the one place the command reads $WEIGHTSYNC_AUTH_TOKEN.

A bad value is an `argparse.ArgumentTypeError`: argparse prints the usage and
"argument --FLAG: ..." and exits with status 2, before any command runs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from weightsync.auth import TOKEN_ENV

__all__ = ["DefaultsFormatter", "add_auth_token", "at_least", "auth_token", "port", "positive_seconds", "seconds"]


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every command's --help format: each option's help ends with its default, "(default: X)",
    unless the help already says what it is (a default that depends on other flags or on the
    machine is written out in the help itself), or the option has none (None, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if "default" in help_text or default in (None, "", [], (), argparse.SUPPRESS) or not action.option_strings:
            return action.help
        if isinstance(default, bool):  # a flag: --x/--no-x says its default by name, a plain flag is off
            if not isinstance(action, argparse.BooleanOptionalAction):
                return action.help
            default = f"--{'' if default else 'no-'}{action.dest.replace('_', '-')}"
        elif isinstance(default, (list, tuple)):
            default = ",".join(str(item) for item in default)
        elif isinstance(default, float) and default.is_integer():
            default = int(default)  # 60, not 60.0: as it would be typed
        return f"{help_text} (default: {default})".lstrip()


def seconds(text: str) -> float:
    """A non-negative number of seconds (0: do not wait)."""
    value = _float(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A positive number of seconds: a bound on a wait that must be able to succeed."""
    value = _float(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return int(text)


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer type that refuses values below `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def add_auth_token(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--auth-token", default=None, help=f"{what} (default: ${TOKEN_ENV})")


def auth_token(args: argparse.Namespace) -> str | None:
    """--auth-token, else $WEIGHTSYNC_AUTH_TOKEN, else None: the library gets the token explicitly."""
    if args.auth_token is not None:
        token: str = args.auth_token
        return token
    return os.environ.get(TOKEN_ENV) or None


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
