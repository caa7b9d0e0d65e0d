"""`weightsync digest`: compare the content digest servers hold with each other, a checkpoint or a value.

weightsync digest [--to URL ...] [--model DIR [--cast DTYPE]] [--expect HEX]
"""

from __future__ import annotations

import argparse
import json

from weightsync.cli.args import DefaultsFormatter, add_auth_token, auth_token, positive_seconds
from weightsync.cli.push import CAST_DTYPES, waiting_line
from weightsync.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    digest = subparsers.add_parser(
        "digest",
        formatter_class=DefaultsFormatter,
        help="check the content digest servers hold against each other, a checkpoint or a value",
        description="Read each server's content digest (from its last verified push) and compare. With "
        "--model, the expected digest is computed from that checkpoint as a push would send it "
        "(whatever its bucket size). Exit status 0 only "
        "if every server holds the expected digest (without one, the same digest as the others).",
    )
    digest.add_argument("--to", nargs="*", default=[], metavar="URL", help="server URLs (http://HOST:PORT)")
    digest.add_argument("--model", default=None, help="checkpoint directory (*.safetensors) to compute it from")
    digest.add_argument(
        "--cast",
        choices=CAST_DTYPES,
        default=None,
        metavar="DTYPE",
        help="with --model: the digest of the checkpoint as `weightsync push --cast DTYPE` sends it (every "
        "floating-point tensor as DTYPE), e.g. a bfloat16 push of a float32 checkpoint",
    )
    digest.add_argument("--expect", default=None, metavar="HEX", help="the digest a push reported")
    digest.add_argument(
        "--timeout",
        type=positive_seconds,
        default=60.0,
        help="seconds any HTTP call, and the wait for servers that are starting, may last",
    )
    add_auth_token(digest, "the servers' shared secret")
    digest.add_argument("--json", action="store_true", help="print the result as JSON")
    digest.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weightsync.checkpoint import SafetensorsSource
    from weightsync.client import ServerGroup
    from weightsync.digest import source_digest
    from weightsync.dtypes import dtype_from_name

    if not args.to and not args.model:
        raise ConfigError("give --to URL ... (what servers hold), --model DIR (what a push would send), or both")
    if args.cast and not args.model:
        raise ConfigError("--cast applies to --model: the checkpoint's digest as a cast push sends it")
    with ServerGroup(timeout=args.timeout, auth_token=auth_token(args)) as group:
        infos, errors = group.join(args.to, waiting_line("digest"))
    if errors:
        raise next(iter(errors.values()))
    held = {url: {"version": info["version"], "content_digest": info["content_digest"]} for url, info in infos.items()}
    expected = args.expect
    if args.model:
        computed = source_digest(SafetensorsSource(args.model), dtype_from_name(args.cast) if args.cast else None)
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
            print(f"  {url}: version {entry['version']} {entry['content_digest'] or '-'} {verdict(entry, expected)}")
    return 0 if ok else 1


def verdict(entry: dict[str, object], expected: str | None) -> str:
    digest = entry["content_digest"]
    if not digest:
        return "no digest (push with --verify)"
    return "match" if digest == expected else "MISMATCH"
