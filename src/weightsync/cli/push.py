"""`weightsync push`: push a safetensors checkpoint to running rollout servers.

weightsync push --model DIR --to http://127.0.0.1:8000 [URL ...] [--version N] [--verify bucket]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from weightsync.checksum import VERIFY_MODES
from weightsync.cli.args import add_auth_token, at_least, auth_token, positive_seconds

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    push = subparsers.add_parser(
        "push",
        help="push a safetensors checkpoint to running servers",
        description="Read DIR's safetensors checkpoint one tensor at a time and push it to every server.",
    )
    push.add_argument("--model", required=True, help="model directory with *.safetensors")
    push.add_argument("--to", nargs="+", required=True, metavar="URL", help="server URLs (http://HOST:PORT)")
    push.add_argument("--version", type=at_least(0), default=None, help="weight version (default: highest served + 1)")
    push.add_argument("--timeout", type=positive_seconds, default=60.0, help="seconds any wait may last (default 60)")
    push.add_argument("--verify", choices=VERIFY_MODES, default="off", help="bucket or full checksums (default off)")
    add_auth_token(push, "the servers' shared secret")
    push.add_argument("--json", action="store_true", help="print the report as JSON")
    push.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weightsync.checkpoint import SafetensorsSource
    from weightsync.sender import WeightSender
    from weightsync.server.client import RolloutClient

    token = auth_token(args)
    infos = []
    for url in args.to:
        with RolloutClient(url, timeout=args.timeout, auth_token=token) as client:
            infos.append(client.weight_info())
    addresses = [address for info in infos for address in info["addresses"]]
    version = args.version
    if version is None:
        version = max((info["version"] for info in infos if info["version"] is not None), default=0) + 1
    source = SafetensorsSource(args.model)
    with WeightSender(addresses, timeout=args.timeout, verify=args.verify, auth_token=token) as sender:
        report = sender.push(source, version)
    if args.json:
        print(json.dumps(report_json(report, args.to, addresses)))
    else:
        print(
            f"version {report.version}: {report.total_bytes} bytes, {report.num_tensors} tensors in "
            f"{report.seconds:.3f} s ({report.gbps:.2f} GB/s)"
        )
        for url, outcome in zip(args.to, report.outcomes, strict=False):
            status = "committed" if outcome.committed else f"FAILED {outcome.kind}: {outcome.error}"
            print(f"  {url} ({outcome.address}): {status}")
    return 0 if report.ok else 1


def report_json(report: Any, urls: list[str], addresses: list[str]) -> dict[str, Any]:
    by_address = dict(zip(addresses, urls, strict=False))
    return {
        "version": report.version,
        "bytes": report.total_bytes,
        "num_tensors": report.num_tensors,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "ok": report.ok,
        "content_digest": report.content_digest,
        "outcomes": [
            {
                "url": by_address.get(o.address),
                "address": o.address,
                "committed": o.committed,
                "kind": o.kind,
                "error": o.error,
            }
            for o in report.outcomes
        ],
    }
