"""`weightsync digest`: what a server holds, checked against a checkpoint, a pushed report, or the
other servers, without moving the weights again; and `source_digest` equal to what a push sends."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import receiving, sending
from tests.server.conftest import live_server
from weightsync.checkpoint import SafetensorsSource
from weightsync.cli import main
from weightsync.digest import source_digest


@pytest.mark.parametrize("transport", ["shm", "tcp", "collective"])
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_source_digest_is_the_digest_a_verified_push_commits(transport, cast):
    source = {"a": torch.randn(300, 100), "b": torch.arange(50_000), "c": torch.randn(7, 3).t()}
    landed: dict[str, torch.Tensor] = {}
    with (
        receiving(lambda named: landed.update(named), transport) as receiver,
        sending(receiver.address, bucket_bytes=65536, verify="bucket", cast=cast) as sender,
    ):
        report = sender.push(source, version=1)
        assert report.ok and report.num_buckets > 2
        assert report.content_digest == receiver.content_digest == source_digest(source, cast)
    source["a"][0, 0] += 1
    assert source_digest(source, cast) != report.content_digest


@pytest.mark.parametrize("bucket_bytes", [4096, 65536, 1 << 20])
def test_the_content_digest_does_not_depend_on_the_bucket_layout(bucket_bytes):
    source = {"a": torch.randn(300, 100), "b": torch.arange(50_000), "c": torch.randn(7, 3).t()}
    with (
        receiving(lambda named: None, "shm") as receiver,
        sending(receiver.address, bucket_bytes=bucket_bytes, verify="bucket") as sender,
    ):
        report = sender.push(source, version=1)
        assert report.ok and report.content_digest == receiver.content_digest == source_digest(source)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(["digest", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_digest_cli_checks_servers_against_the_checkpoint(tiny_models, capsys):
    model = tiny_models["qwen2"]
    with live_server(model) as first, live_server(model) as second:
        urls = [first.url, second.url]
        with sending([first.address, second.address], verify="bucket") as sender:
            report = sender.push(SafetensorsSource(model), version=1)
        assert report.ok

        code, out = run(capsys, "--to", *urls, "--model", str(model))
        assert code == 0 and out["ok"] and out["expected"] == report.content_digest
        assert {entry["content_digest"] for entry in out["servers"].values()} == {report.content_digest}
        assert run(capsys, "--to", *urls, "--expect", report.content_digest)[0] == 0
        assert run(capsys, "--to", *urls)[0] == 0, "without an expectation: they agree with each other"

        # the second server gets other weights: it no longer holds the checkpoint
        other = {name: tensor + 1 for name, tensor in SafetensorsSource(model).tensors()}
        with sending(second.address, verify="bucket") as sender:
            assert sender.push(other, version=2).ok
        code, out = run(capsys, "--to", *urls, "--model", str(model))
        assert code == 1 and not out["ok"]
        assert out["servers"][first.url]["content_digest"] == out["expected"]
        assert out["servers"][second.url]["content_digest"] != out["expected"]
        assert out["servers"][second.url]["version"] == 2

        # an unverified push leaves no digest to compare: not a match
        with sending(first.address) as sender:
            assert sender.push(SafetensorsSource(model), version=3).ok
        code, out = run(capsys, "--to", first.url, "--model", str(model))
        assert code == 1 and out["servers"][first.url]["content_digest"] == ""


def test_digest_cli_of_a_checkpoint_alone(tiny_models, capsys):
    model = tiny_models["qwen2"]
    code, out = run(capsys, "--model", str(model))
    assert code == 0 and out["expected"] == source_digest(SafetensorsSource(model))
    assert main(["digest"]) == 2
