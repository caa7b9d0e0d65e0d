"""What a demo run leaves: the trained policy (not the initial one) as a checkpoint that the
README's next exercise serves, pushes and checks, run here as the README writes it; a plot that
names the engine, the mode and the payload and marks kill and restart events."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import free_port
from weightsync.demo import task
from weightsync.demo.loop import DemoConfig, run
from weightsync.demo.report import event_marks, plot, title

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A short colocated run: its directory, and the trainer's weights after the last step."""
    out = tmp_path_factory.mktemp("demo")
    final: dict[str, torch.Tensor] = {}

    def keep(record: dict[str, Any], model: torch.nn.Module, rollouts: Any) -> None:
        final.update({name: t.detach().clone() for name, t in model.state_dict().items()})

    run(DemoConfig(mode="colocated", steps=4, out=out, progress=False), on_step=keep)
    return out, final


def test_the_run_saves_the_trained_policy(trained) -> None:
    out, final = trained
    saved = load_file(out / "policy" / "model.safetensors")
    initial = task.build_policy(out / "initial", seed=0).state_dict()
    assert saved and set(saved) <= set(final)
    assert all(torch.equal(saved[name], final[name]) for name in saved)
    assert any(not torch.equal(saved[name], initial[name]) for name in saved), "the initial weights were saved"


def test_each_step_records_what_its_sync_moved(trained) -> None:
    out, _ = trained
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for record in records:
        assert record["sync_modes"] in (["full"], ["delta"])  # one engine, colocated
        assert 0.0 <= record["changed_fraction"] <= 1.0
        if record["sync_modes"] == ["delta"]:
            assert record["wire_bytes"] <= record["sync_bytes"] / 2
        else:  # at the demo's learning rate nearly every fp32 weight moves: the patch would not pay
            assert record["wire_bytes"] == record["sync_bytes"]


def test_a_run_that_changes_nothing_syncs_nothing_but_its_first_push(tmp_path) -> None:
    # "all": the colocated demo's receivers are in process, where delta=True sends in full
    config = DemoConfig(mode="colocated", steps=2, lr=0.0, out=tmp_path, progress=False, delta="all")
    records = run(config)
    assert [r["sync_modes"] for r in records] == [["delta"], ["delta"]]
    assert [(r["wire_bytes"], r["changed_fraction"]) for r in records] == [(0, 0.0), (0, 0.0)]


def test_at_bf16_and_a_small_rate_most_weights_keep_their_bits_and_syncs_are_patches(tmp_path) -> None:
    config = DemoConfig(
        mode="colocated", steps=3, lr=1e-5, wire_dtype="bfloat16", out=tmp_path, progress=False, delta="all"
    )
    records = run(config)
    assert [r["sync_modes"] for r in records] == [["delta"]] * 3
    for record in records:
        assert 0.0 < record["changed_fraction"] < 0.5
        assert 0 < record["wire_bytes"] < record["sync_bytes"] / 2
    plot(records, tmp_path / "plot.png")  # the delta syncs are marked at their bytes
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def readme_exercise() -> list[str]:
    from tests.doc_snippets import snippet

    return snippet("README.md", "### Next: serve the policy you trained").text.strip().splitlines()


@pytest.mark.slow
def test_the_readme_exercise_serves_pushes_and_checks_the_trained_policy(trained, tmp_path) -> None:
    out, _ = trained
    port = free_port()
    command = tmp_path / "bin" / "weightsync"  # this test's interpreter stands in for .venv's
    command.parent.mkdir()
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m weightsync "$@"\n')
    command.chmod(0o755)
    lines = ["trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]  # a failing step leaves no server behind
    for line in readme_exercise():
        if line.startswith("source .venv/bin/activate"):
            line = f'export PATH="{command.parent}:$PATH"'
        line = line.replace("runs/demo/policy", str(out / "policy")).replace("8000", str(port))
        lines.append(line)
        if line.startswith("weightsync serve"):  # the README says: wait for its announcement
            lines.append(
                f"until curl -s http://127.0.0.1:{port}/health | grep -q 'waiting for weights'; do sleep 0.2; done"
            )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=180,
        env=os.environ | {"PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
    assert "version 1: committed on 1 of 1 servers" in done.stdout, done.stdout
    assert re.search(r"version 1 [0-9a-f]{32} match", done.stdout), done.stdout
    assert re.search(r'"token_ids":\[\d+,\d+,\d+,\d+\]', done.stdout), done.stdout
    # chat works too (the policy's chat template): the same answer as the completion's
    text, content = re.search(r'"text":"([^"]*)"', done.stdout), re.search(r'"content":"([^"]*)"', done.stdout)
    assert text and content and content.group(1) == text.group(1), done.stdout


RECORDS = [
    {"step": 0, "reward_mean": 0.1, "sync_seconds": 0.01, "sync_bytes": 300800, "events": []},
    {
        "step": 1,
        "reward_mean": 0.2,
        "sync_seconds": 0.01,
        "sync_bytes": 300800,
        "events": [
            "server 0 killed (SIGKILL)",
            "server 0 died; continuing on 1",
            "server 0 restarted; it serves after the next push",
        ],
    },
    {
        "step": 2,
        "reward_mean": 0.3,
        "sync_seconds": 0.01,
        "sync_bytes": 300800,
        "events": ["server 0 rejoined with the current weights"],
    },
]


def test_the_plot_names_engine_mode_and_payload_and_marks_events(tmp_path) -> None:
    assert title(RECORDS, "vllm", "disaggregated") == (
        "weightsync demo: GRPO (disaggregated, vllm engine)\n294 KiB model pushed after every step"
    )
    # a full-model run whose model_bytes differ from what a push sends is still a full-model run
    full = [r | {"model_bytes": 304_384, "adapter": None} for r in RECORDS]
    assert title(full, "hf", "").endswith("294 KiB model pushed after every step")
    lora = [r | {"sync_bytes": 8192, "adapter": "policy-lora"} for r in RECORDS]
    assert title(lora, "hf", "").endswith("8 KiB LoRA adapter pushed after every step")
    assert event_marks(RECORDS) == [
        (1, "server 0 killed (SIGKILL)", "tab:red"),
        (1, "server 0 died", "tab:red"),
        (1, "server 0 restarted", "tab:orange"),
        (2, "server 0 rejoined with the current weights", "tab:green"),
    ]
    plot(RECORDS, tmp_path / "plot.png", engine="vllm", mode="disaggregated")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_the_demo_marks_a_killed_server(tmp_path) -> None:
    """The kill itself is an event of its step (the plot draws it), before the loop notices."""
    from weightsync.demo.rollouts import ServerFleet

    fleet = ServerFleet.__new__(ServerFleet)
    fleet.events, fleet.servers = [], []

    class Dead:
        index = 0

        def kill(self) -> None:
            pass

    fleet.servers.append(Dead())  # type: ignore[arg-type]
    fleet.kill(0)
    assert fleet.events == ["server 0 killed (SIGKILL)"]


def test_serve_offers_every_serving_transport(capsys: pytest.CaptureFixture[str]) -> None:
    from weightsync.cli import build_parser
    from weightsync.transports import serving_transports

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    offered = re.search(r"--transport \{([^}]*)\}", capsys.readouterr().out)
    assert offered is not None
    choices = offered.group(1).split(",")
    assert choices == serving_transports() and "cudaipc" in choices and "inproc" not in choices
    for transport in choices:
        assert build_parser().parse_args(["serve", "--model", "m", "--transport", transport]).transport == transport
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--transport", "inproc"])
    assert "invalid choice: 'inproc'" in capsys.readouterr().err


def test_an_interrupted_run_reads_the_steps_it_recorded(tmp_path: Path) -> None:
    """steps.jsonl as an interrupted run leaves it: whole lines, then one cut short."""
    from weightsync.cli.demo import read_steps

    path = tmp_path / "steps.jsonl"
    assert read_steps(path) == []
    path.write_text('{"step": 0}\n{"step": 1}\n{"ste')
    assert read_steps(path) == [{"step": 0}, {"step": 1}]
