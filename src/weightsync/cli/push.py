"""`weightsync push`: push a safetensors checkpoint, or a PEFT LoRA adapter folder, to running
rollout servers.

weightsync push --model DIR --to http://127.0.0.1:8000 [URL ...] [--version N] [--verify bucket] [--cast bfloat16]
weightsync push --model ADAPTER_DIR --to URL [--adapter-name NAME]    # adapter_config.json found: an adapter

Like `WeightSender.push`, it fails when any server did not commit (exit status 1), and it
reports per server and goes on with the others: a server that does not answer, refuses or fails
is one line on stderr, the servers that answered are pushed to. The summary comes last, on one
line: how many servers committed, and what moved, or, when none did, that the push was refused
(or failed) and why.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync.checksum import VERIFY_MODES
from weightsync.cli.args import DefaultsFormatter, add_auth_token, at_least, auth_token, positive_seconds
from weightsync.cli.errors import FAILED, describe
from weightsync.errors import ConfigError, one_line

if TYPE_CHECKING:
    from weightsync.client import Waiting
    from weightsync.messages import Adapter
    from weightsync.report import SyncReport

__all__ = ["CAST_DTYPES", "add_parser", "run", "waiting_line"]

CAST_DTYPES = ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2")
"""What --cast accepts: the dtype every floating-point tensor is sent as."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    push = subparsers.add_parser(
        "push",
        formatter_class=DefaultsFormatter,
        help="push a safetensors checkpoint to running servers",
        description="Read DIR's safetensors checkpoint one tensor at a time and push it to every server "
        "that answers; each server's outcome is reported, and the exit status is 1 if any did not commit.",
    )
    push.add_argument(
        "--model",
        required=True,
        help="model directory with *.safetensors, or a PEFT LoRA adapter folder (adapter_config.json, "
        "adapter_model.safetensors: the adapter is pushed, served by --adapter-name)",
    )
    push.add_argument(
        "--adapter-name",
        default=None,
        metavar="NAME",
        help="with an adapter folder: the name requests ask for it by (default: the folder's name)",
    )
    push.add_argument("--to", nargs="+", required=True, metavar="URL", help="server URLs (http://HOST:PORT)")
    push.add_argument(
        "--version", type=at_least(0), default=None, help="weight version (default: highest committed + 1)"
    )
    push.add_argument(
        "--allow-older-version",
        action="store_true",
        help="push a --version at or below the last one a server committed (it moves that server back)",
    )
    push.add_argument("--timeout", type=positive_seconds, default=60.0, help="seconds any wait may last")
    push.add_argument("--verify", choices=VERIFY_MODES, default="off", help="bucket or full checksums")
    push.add_argument(
        "--cast",
        choices=CAST_DTYPES,
        default=None,
        metavar="DTYPE",
        help=f"send every floating-point tensor as DTYPE ({', '.join(CAST_DTYPES)}), e.g. a bfloat16 "
        "checkpoint into a float32 server (default: as stored)",
    )
    add_auth_token(push, "the servers' shared secret")
    push.add_argument("--json", action="store_true", help="print the report as JSON")
    push.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weightsync.client import ServerGroup
    from weightsync.dtypes import dtype_from_name
    from weightsync.options import SenderOptions

    cast = dtype_from_name(args.cast) if args.cast else None
    # the report is read here, server by server: every outcome is printed, then the exit status says
    options = SenderOptions(
        timeout=args.timeout,
        verify=args.verify,
        auth_token=auth_token(args),
        cast=cast,
        raise_on_failure=False,
        allow_older_version=args.allow_older_version,
    )
    with ServerGroup(options) as group:
        infos, errors = group.join(args.to, waiting_line("push"))
        unreachable = {url: describe(exc, "weightsync push")[1] for url, exc in errors.items()}
        for url, message in unreachable.items():
            print(f"weightsync push: {url}: {message}", file=sys.stderr)
        if not infos:
            if args.json:
                print(json.dumps({"ok": False, "version": None, "outcomes": unreachable_json(unreachable)}))
            return FAILED
        tensors, adapter = what_to_push(args.model, args.adapter_name)
        version = choose_version(args.version, served_versions(infos, adapter), args.allow_older_version)
        report = group.push(tensors, version, adapter=adapter)
    urls = {address: url for url, info in infos.items() for address in info["addresses"]}
    for url, reasons in failures_by_server(report, urls).items():
        print(f"weightsync push: {url}: {'; '.join(reasons)}", file=sys.stderr)
    if args.json:
        outcomes = outcomes_json(report, urls, unreachable)
        print(json.dumps(report_json(report) | {"ok": report.ok and not unreachable, "outcomes": outcomes}))
    else:
        failed = {urls[outcome.address] for outcome in report.failed}
        for url in dict.fromkeys(urls[outcome.address] for outcome in report.outcomes):
            if url not in failed:  # every worker of the server committed
                print(f"{url}: committed version {report.version}")
        print(summary(report, urls, len(infos) + len(unreachable), adapter))
    return 0 if report.ok and not unreachable else FAILED


def failures_by_server(report: SyncReport, urls: dict[str, str]) -> dict[str, list[str]]:
    """Each server that did not commit, with its workers' reasons, each said once (a server's
    tensor-parallel workers mostly fail for the same reason)."""
    reasons: dict[str, dict[str, None]] = {}
    for outcome in report.failed:
        why = f"{outcome.kind}: {in_flags(one_line(outcome.error))}"
        reasons.setdefault(urls[outcome.address], {})[why] = None
    return {url: list(said) for url, said in reasons.items()}


def in_flags(message: str) -> str:
    """A receiver's message in this command's words: its fixes `cast=torch.X` and
    `allow_older_version=True` (the Python API's) are `--cast X` and `--allow-older-version` here."""
    message = message.replace("allow_older_version=True", "--allow-older-version")
    return re.sub(r"cast=torch\.(\w+)", r"--cast \1", message)


def summary(report: SyncReport, urls: dict[str, str], num_servers: int, adapter: Adapter | None = None) -> str:
    """The last line: how many servers committed and what moved. A push that none committed moved
    nothing anyone serves: the line says it was refused (or failed) and with which errors, whose
    messages stderr gave once, one line per server."""
    from weightsync.report import moved

    failed = {urls[outcome.address] for outcome in report.failed}
    committed = len(set(urls.values()) - failed)
    what = "" if adapter is None else f"adapter {adapter.name!r} "
    head = f"{what}version {report.version}: committed on {committed} of {num_servers} servers"
    if not committed:
        verb = "refused" if all(outcome.refused for outcome in report.failed) else "failed"
        kinds = ", ".join(dict.fromkeys(outcome.kind for outcome in report.failed))
        return f"{head}: {verb} ({kinds}, the reason is on stderr); no weights moved"
    return f"{head}; {report.num_tensors} tensors, {moved(report.total_bytes, report.seconds)}"


def waiting_line(command: str) -> Waiting:
    """What `ServerGroup.join` hears of a server that is starting, as one line on stderr."""

    def waiting(url: str, wait_s: float, why: str) -> None:
        print(f"weightsync {command}: waiting up to {wait_s:.0f} s for {url}: {why}", file=sys.stderr, flush=True)

    return waiting


def what_to_push(model: str, adapter_name: str | None) -> tuple[Any, Adapter | None]:
    """The checkpoint in folder `model` as a source, or, where it holds adapter_config.json, the
    PEFT LoRA adapter's tensors and its `Adapter` (served as `adapter_name`, default the folder's
    name; each server checks its rank and targets against its base before a byte moves).

    Raises:
        ConfigError: --adapter-name without an adapter folder; an adapter that cannot be pushed
            (not LoRA, no tensors); no such folder (the source says, as it opens it).
    """
    from weightsync.checkpoint import SafetensorsSource
    from weightsync.lora import adapter_from_dir

    folder = Path(model)
    if (folder / "adapter_config.json").is_file():
        return adapter_from_dir(folder, adapter_name or folder.resolve().name)
    if adapter_name is not None:
        raise ConfigError(f"--adapter-name is for a PEFT adapter folder; {model} has no adapter_config.json")
    return SafetensorsSource(model), None


def served_versions(infos: dict[str, dict[str, Any]], adapter: Adapter | None) -> dict[str, int]:
    """The version each server committed last of what is pushed: its base weights (also while
    dirty), or the adapter."""
    if adapter is None:
        last = {url: info.get("last_committed", info["version"]) for url, info in infos.items()}
        return {url: version for url, version in last.items() if version is not None}
    return {
        url: served["version"]
        for url, info in infos.items()
        for served in info.get("adapters", [])
        if served["name"] == adapter.name
    }


def choose_version(asked: int | None, served: dict[str, int], allow_older: bool) -> int:
    """--version, or the highest version any server committed (of `served`, by URL), plus one.

    Raises:
        ConfigError: --version is at or below what a server committed, without --allow-older-version.
    """
    if asked is None:
        return max(served.values(), default=0) + 1
    not_older = {url: version for url, version in served.items() if version >= asked}
    if not_older and not allow_older:
        url, version = max(not_older.items(), key=lambda item: item[1])
        than = "lower than" if version > asked else "the same as"
        raise ConfigError(
            f"--version {asked} is {than} version {version}, which {url} committed last: versions only go "
            "forward; give --allow-older-version to push it anyway, or leave --version out (highest committed + 1)"
        )
    return asked


def report_json(report: Any) -> dict[str, Any]:
    return {
        "version": report.version,
        "bytes": report.total_bytes,
        "num_tensors": report.num_tensors,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "ok": report.ok,
        "content_digest": report.content_digest,
    }


def outcomes_json(report: Any, urls: dict[str, str], unreachable: dict[str, str]) -> list[dict[str, Any]]:
    pushed = [
        {"url": urls[o.address], "address": o.address, "committed": o.committed, "kind": o.kind, "error": o.error}
        for o in report.outcomes
    ]
    return pushed + unreachable_json(unreachable)


def unreachable_json(unreachable: dict[str, str]) -> list[dict[str, Any]]:
    return [
        {"url": url, "address": None, "committed": False, "kind": "ServerError", "error": message}
        for url, message in unreachable.items()
    ]
