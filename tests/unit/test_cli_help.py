"""`weightsync COMMAND --help` (and `weightsync-bench --help`) shows every option's default, the
same way in every command."""

from __future__ import annotations

import argparse

import pytest

from weightsync.cli import build_parser
from weightsync_bench.args import build_parser as build_bench_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    """Each `weightsync` command's parser, and the benchmarks' `weightsync-bench` as "bench"."""
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices) | {"bench": build_bench_parser()}


def has_a_default(action: argparse.Action) -> bool:
    """An option whose value is something when it is not given (a plain on/off flag is off)."""
    plain_flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
    return bool(action.option_strings) and not plain_flag and action.default not in (None, "", [], argparse.SUPPRESS)


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_option_with_a_default_shows_it(command: str) -> None:
    parser = commands()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if has_a_default(action):
            shown = formatter._expand_help(action) if action.help else ""
            assert "default" in shown, f"weightsync {command} {action.option_strings[-1]}: {shown!r}"


def test_defaults_read_as_they_would_be_typed() -> None:
    text = {name: parser.format_help() for name, parser in commands().items()}
    flat = {name: " ".join(help_text.split()) for name, help_text in text.items()}
    assert (
        "seconds a request waits for weights before its 503 (which carries Retry-After) (default: 8)" in flat["serve"]
    )
    assert "run the baselines (default: --baselines)" in flat["bench"]
    assert "seconds any wait may last (default: 60)" in flat["push"]
    assert "(default: None)" not in " ".join(flat.values())
