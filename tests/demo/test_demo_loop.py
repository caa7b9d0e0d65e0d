"""The demo loop end to end, small: what the servers serve after sync N is what the trainer's
step-N weights generate; versions and the staleness bound hold; a killed server is reported,
the loop goes on, and its restarted replacement serves the current version."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ENGINES
from weightsync.demo import task
from weightsync.demo.loop import ADAPTER, DemoConfig, run
from weightsync.demo.report import plot, summary

PROMPT = task.encode(task.prompt_text(3))


def trainer_greedy(model: torch.nn.Module) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=task.ANSWER_LENGTH, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def assert_servers_serve_the_trainer(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> list[int]:
    """Each live server's greedy completion is the trainer's, at the version just pushed;
    returns the indices of the servers checked."""
    expected = trainer_greedy(model)
    checked = []
    for server in fleet:
        body = server.client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": task.ANSWER_LENGTH, "temperature": 0, "return_token_ids": True},
        ).json()
        assert body["weight_version"] == record["weight_version"]
        assert body["choices"][0]["token_ids"] == expected, (record["step"], server.index)
        checked.append(server.index)
    return checked


@pytest.mark.slow
def test_disaggregated_loop_with_a_killed_server(tmp_path: Path) -> None:
    config = DemoConfig(
        steps=6, prompts_per_step=4, group=4, kill_server_at=2, out=tmp_path, timeout=30.0, progress=False
    )
    checked: list[tuple[int, int]] = []

    def check(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> None:
        checked.extend((record["step"], index) for index in assert_servers_serve_the_trainer(record, model, fleet))

    records = run(config, on_step=check)
    assert [r["step"] for r in records] == list(range(6))
    assert [r["weight_version"] for r in records] == list(range(1, 7))
    for record in records:
        step = record["step"]
        assert all(step - config.max_staleness <= v <= step for v in record["sample_versions"]), record
        assert 0 <= record["max_version_lag"] <= config.max_staleness
        assert record["samples"] > 0
    assert records[1]["max_version_lag"] == 1  # one-step off-policy from the second step on
    events = " | ".join(records[2]["events"])
    assert "server 0 died" in events or "server 0 stopped answering" in events, events
    assert "server 0 rejoined with the current weights" in events, events
    assert all(r["receivers_committed"] == r["receivers"] == 2 for r in records)
    # every step after the kill was checked on both servers, the restarted one included
    assert {(s, i) for s in range(2, 6) for i in (0, 1)} <= set(checked)
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(6))


def test_colocated_loop_learns_and_serves_the_trainer_weights(tmp_path: Path) -> None:
    config = DemoConfig(mode="colocated", steps=30, out=tmp_path, progress=False)
    served: list[bool] = []

    def check(record: dict[str, Any], model: torch.nn.Module, local: Any) -> None:
        assert local.receiver.version == record["weight_version"]
        assert record["max_version_lag"] == 0
        if record["step"] % 10 == 0:
            from weightsync.serving.hf.base import SamplingParams

            local.engine.add_request("check", PROMPT, SamplingParams(max_tokens=task.ANSWER_LENGTH))
            tokens: list[int] = []
            while local.engine.has_unfinished():
                for output in local.engine.step():
                    tokens += output.new_token_ids
            served.append(tokens == trainer_greedy(model))

    records = run(config, on_step=check)
    assert served == [True, True, True]
    result = summary(records)
    assert result["reward_last_10pct"] > result["reward_first_10pct"] + 0.2, result
    # the whole model moves (the tied lm_head once, as a push sends it): 100% of its bytes
    assert result["pushes"] == "whole model" and result["median_sync_fraction"] == 1.0, result
    plot(records, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
def test_disaggregated_loop_on_vllm_servers(tmp_path: Path) -> None:
    """The default where vLLM is installed: the servers' greedy output after every push is the
    trainer's own."""
    config = DemoConfig(engine="vllm", steps=3, prompts_per_step=4, group=4, out=tmp_path, progress=False)
    checked: list[int] = []

    def check(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> None:
        checked.extend(record["step"] for _ in assert_servers_serve_the_trainer(record, model, fleet))

    records = run(config, on_step=check)
    assert checked == [0, 0, 1, 1, 2, 2]
    assert all(r["receivers_committed"] == 2 for r in records)


def assert_servers_serve_the_adapter(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> None:
    """Each server answers a request naming the demo's adapter with the trainer's greedy
    completion, from the adapter version just pushed, on the base pushed first (version 0)."""
    expected = trainer_greedy(model)
    for server in fleet:
        body = server.client.post(
            "/v1/completions",
            json={
                "model": ADAPTER,
                "prompt": PROMPT,
                "max_tokens": task.ANSWER_LENGTH,
                "temperature": 0,
                "return_token_ids": True,  # vLLM lists them only when asked
            },
        ).json()
        assert (body["weight_version"], body["base_version"]) == (record["weight_version"], 0), body
        assert body["choices"][0]["token_ids"] == expected, (record["step"], server.index)


def assert_engines_sample_from_the_trainers_adapter(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> None:
    """Sampled completions (temperature 1) carry the logprobs the trainer's adapter gives their
    tokens: the distribution served is the one trained, scale (alpha / rank) included, not only
    its most likely token."""
    from weightsync.demo.loop import token_logprobs
    from weightsync.demo.rollouts import Request

    prompts = [task.encode(task.prompt_text(d)) for d in range(10)]
    samples = fleet.generate(Request(prompts, 2, task.ANSWER_LENGTH, 1.0, seed=record["step"], adapter=ADAPTER))
    with torch.no_grad():
        for sample in samples:
            assert sample.weight_version == record["weight_version"]
            ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
            trainer = token_logprobs(model, ids)[0, len(sample.prompt_ids) - 1 :]
            torch.testing.assert_close(torch.tensor(sample.logprobs), trainer, atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_lora_loop_pushes_only_the_adapter_and_the_servers_serve_it(tmp_path: Path, engine: str) -> None:
    config = DemoConfig(
        engine=engine, lora_rank=1, pretrain_steps=20, lr=1e-2, steps=3, prompts_per_step=4, group=4, out=tmp_path,
        progress=False,
    )  # fmt: skip
    checked: list[list[int]] = []

    def check(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> None:
        assert_servers_serve_the_adapter(record, model, fleet)
        assert_engines_sample_from_the_trainers_adapter(record, model, fleet)
        checked.append(trainer_greedy(model))

    records = run(config, on_step=check)
    assert len(checked) == 3
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]  # q k v o gate up down
    adapter_bytes = 2 * sum(4 * (fan_in + fan_out) for fan_in, fan_out in shapes)  # rank 1, fp32, 2 layers
    assert all(r["sync_bytes"] == r["wire_bytes"] == adapter_bytes for r in records)
    assert all(r["model_bytes"] == 300_800 and r["receivers_committed"] == 2 for r in records)
    assert summary(records)["median_sync_fraction"] < 0.05
    # what the run leaves: the base, loadable as it is, and the adapter as PEFT saves it
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert sorted(base.state_dict()) == sorted(task.build_policy(tmp_path / "fresh").state_dict())
    assert trainer_greedy(PeftModel.from_pretrained(base, tmp_path / "adapter").eval()) == checked[-1]


@pytest.mark.slow
def test_a_restarted_server_gets_the_base_before_the_adapter(tmp_path: Path) -> None:
    config = DemoConfig(
        lora_rank=1, pretrain_steps=20, lr=1e-2, steps=5, prompts_per_step=4, group=4, kill_server_at=1, out=tmp_path,
        timeout=30.0, progress=False,
    )  # fmt: skip
    checked: list[tuple[int, int]] = []

    def check(record: dict[str, Any], model: torch.nn.Module, fleet: Any) -> None:
        assert_servers_serve_the_adapter(record, model, fleet)
        checked.extend((record["step"], server.index) for server in fleet)

    records = run(config, on_step=check)
    events = " | ".join(e for r in records for e in r["events"])
    assert "server 0 rejoined with the current weights" in events, events
    rejoined = next(r["step"] for r in records if any("rejoined" in e for e in r["events"]))
    assert (rejoined, 0) in checked  # the restarted server serves the trainer's adapter on base version 0
    assert all(r["receivers_committed"] == r["receivers"] for r in records[rejoined:])
