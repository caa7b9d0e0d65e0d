"""`weightsync digest`: what a server holds, checked against a checkpoint, a pushed report, or the
other servers, without moving the weights again; and `source_digest` equal to what a push sends."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=25, deadline=None)
@given(order=st.permutations(["embed", "layer.0.w", "layer.0.b", "norm", "step"]))
def test_the_content_digest_is_a_value_of_the_named_tensors_not_of_their_order(order):
    weights = {
        "embed": torch.arange(64, dtype=torch.float32).reshape(8, 8),
        "layer.0.w": torch.ones(4, 3),
        "layer.0.b": torch.zeros(3),
        "norm": torch.full((5,), 0.5),
        "step": torch.tensor([7]),
    }
    assert source_digest({name: weights[name] for name in order}) == source_digest(weights)
    swapped = dict(weights, norm=weights["layer.0.b"], **{"layer.0.b": weights["norm"]})
    assert source_digest(swapped) != source_digest(weights), "the names are part of it"


def test_a_module_pushed_in_its_own_order_matches_its_saved_checkpoint(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from tests.models import model_config
    from weightsync import ModuleSource, TensorDictSink

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("llama"))
    model.save_pretrained(tmp_path)
    pushed = ModuleSource(model)
    names = [meta.name for meta in pushed.metas()]
    assert names != sorted(names), "the module's order is not the checkpoint's"
    dest = {name: torch.zeros_like(tensor) for name, tensor in pushed.tensors()}
    with (
        receiving(TensorDictSink(dest), "shm") as receiver,
        sending(receiver.address, verify="bucket") as sender,
    ):
        report = sender.push(pushed, version=1)
    assert report.ok
    code, out = run(capsys, "--model", str(tmp_path))
    assert code == 0 and out["expected"] == report.content_digest == source_digest(dest)


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


def test_digest_cast_checks_a_cast_push_against_its_float32_checkpoint(tiny_models, capsys):
    """A bf16-cast push of an fp32 checkpoint carries the digest of the bf16 wire tensors:
    `--cast bfloat16` computes that one from the checkpoint; without it, it is another."""
    model = tiny_models["qwen2"]
    cast = source_digest(SafetensorsSource(model), torch.bfloat16)
    code, out = run(capsys, "--model", str(model), "--cast", "bfloat16")
    assert code == 0 and out["expected"] == cast != source_digest(SafetensorsSource(model))
    assert main(["digest", "--to", "http://127.0.0.1:9", "--cast", "bfloat16"]) == 2  # --cast is for --model
    assert "--cast applies to --model" in capsys.readouterr().err


def test_a_missing_model_folder_is_named_as_missing(tmp_path, capsys):
    assert main(["digest", "--model", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'}: no such folder" in capsys.readouterr().err
