"""weightsync.integrations.trl against the installed TRL: its experimental contracts, the
weight-transfer protocol against a real rollout server, and a real GRPOTrainer run
(examples/trl_grpo.py) on two rollout servers."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")

# Loading TRL's trainers warns: TRL about its experimental API and about a vLLM newer than it was
# released with, and the vLLM it then imports about torch deprecations. None is ours to act on.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol
    from trl.trainer.grpo_trainer import GRPOTrainer

from weightsync.checkpoint import SafetensorsSource  # noqa: E402
from weightsync.client import RolloutClient  # noqa: E402
from weightsync.demo import task  # noqa: E402
from weightsync.demo.rollouts import ServerFleet  # noqa: E402
from weightsync.digest import source_digest  # noqa: E402
from weightsync.errors import ConfigError, SyncFailed  # noqa: E402
from weightsync.integrations.trl import (  # noqa: E402
    REQUIRED_KEYS,
    TESTED_TRL,
    WeightsyncRollout,
    WeightsyncTransfer,
    group_prompts,
    log_weight_versions,
    request_seed,
)
from weightsync.module_source import ModuleSource  # noqa: E402
from weightsync.options import SenderOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
SENDER = SenderOptions(timeout=TIMEOUT_S, verify="bucket")


# --- The guard: TRL's experimental API as this module relies on it --------------------------------


def test_the_installed_trl_is_the_tested_one() -> None:
    assert trl.__version__ == TESTED_TRL, f"TRL {trl.__version__}: check the contracts below, then move TESTED_TRL"


def test_grpo_trainer_takes_a_rollout_func() -> None:
    parameter = inspect.signature(GRPOTrainer.__init__).parameters.get("rollout_func")
    assert parameter is not None, "GRPOTrainer no longer takes rollout_func"
    assert parameter.default is None


def load_example():  # type: ignore[no-untyped-def]
    """examples/trl_grpo.py as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location("trl_grpo_example", ROOT / "examples" / "trl_grpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_step_trainer(tmp_path: Path, rollout_func, reward_func) -> GRPOTrainer:  # type: ignore[no-untyped-def]
    """A GRPOTrainer on the demo's policy for one step of 2 prompts x 2 completions, no servers."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    example = load_example()  # its GRPOConfig, at 2 prompts x 2 completions and one step
    args = example.grpo_config(
        example.parse_args(["--steps", "1", "--prompts-per-step", "2", "--group", "2", "--out", str(tmp_path)])
    )
    model = task.build_policy(tmp_path / "policy")
    dataset = Dataset.from_dict({"prompt": ["1=", "2="], "digit": [1, 2]})
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    with warnings.catch_warnings():  # TRL: "rollout_func is experimental"
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model,
            reward_funcs=reward_func,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout_func,
        )


def canned_rollout(keys: tuple[str, ...], calls: list[tuple[list, object]]):  # type: ignore[no-untyped-def]
    """A rollout function that answers every prompt "2222" from version 7, every token masked out
    of the loss (`env_mask`), with only `keys`."""

    def rollout(prompts, trainer):  # type: ignore[no-untyped-def]
        calls.append((list(prompts), trainer))
        output = {
            "prompt_ids": [task.encode(p) for p in prompts],
            "completion_ids": [task.encode("2222") for _ in prompts],
            "logprobs": [[-1.0] * task.ANSWER_LENGTH for _ in prompts],
            "weight_version": [7] * len(prompts),
            "env_mask": [[0] * task.ANSWER_LENGTH for _ in prompts],
        }
        return {key: value for key, value in output.items() if key in keys}

    return rollout


@pytest.mark.slow
def test_grpo_trainer_calls_the_rollout_func_as_we_rely_on(tmp_path: Path) -> None:
    calls: list[tuple[list, object]] = []
    seen: list[list[int]] = []

    def reward(completions, weight_version, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(list(weight_version))
        return [1.0] * len(completions)

    trainer = one_step_trainer(tmp_path, canned_rollout(REQUIRED_KEYS + ("weight_version",), calls), reward)
    trainer.train()
    assert [(sorted(prompts), who) for prompts, who in calls] == [(["1=", "1=", "2=", "2="], trainer)]
    assert seen == [[7, 7, 7, 7]], "extra keys no longer reach the reward functions per completion"


@pytest.mark.slow
def test_grpo_trainer_keeps_what_env_mask_zeroes_out_of_the_loss(tmp_path: Path) -> None:
    rollout = canned_rollout(REQUIRED_KEYS + ("env_mask",), [])
    trainer = one_step_trainer(tmp_path, rollout, lambda completions, **kw: [1.0] * len(completions))
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "completions/mean_length" in entry)
    assert logged["completions/mean_length"] == 0.0, "env_mask no longer masks completion tokens"


@pytest.mark.slow
@pytest.mark.parametrize("missing", REQUIRED_KEYS)
def test_grpo_trainer_requires_the_keys_we_return(tmp_path: Path, missing: str) -> None:
    keys = tuple(key for key in REQUIRED_KEYS if key != missing)
    trainer = one_step_trainer(tmp_path, canned_rollout(keys, []), lambda completions, **kw: [1.0] * len(completions))
    with pytest.raises(ValueError, match=missing):
        trainer.train()


def test_the_weight_transfer_implements_trls_protocol() -> None:
    protocol = {
        name: inspect.signature(member)
        for name, member in vars(WeightTransferProtocol).items()
        if callable(member) and not name.startswith("_")
    }
    assert set(protocol) == {"init_weight_transfer", "pause", "send_weights", "resume", "destroy"}
    for name, signature in protocol.items():
        ours = inspect.signature(getattr(WeightsyncTransfer, name))
        assert list(ours.parameters) == list(signature.parameters), name


def test_log_weight_versions_needs_the_versions() -> None:
    scored = log_weight_versions(lambda completions, **kwargs: [1.0] * len(completions))
    logged: dict[str, object] = {}
    assert scored(["a", "b"], weight_version=[3, 4], log_extra=logged.__setitem__, log_metric=logged.__setitem__) == [
        1.0,
        1.0,
    ]
    assert logged == {"weight_version": [3, 4], "weight_version/max": 4.0, "weight_version/min": 3.0}
    with pytest.raises(ConfigError, match="weight_version"):
        scored(["a"])


# --- AsyncGRPO's weight transfer against a real rollout server ------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One `weightsync serve --engine hf` on dummy weights, and the policy it serves."""
    policy_dir = tmp_path_factory.mktemp("policy")
    model = task.build_policy(policy_dir, seed=1)
    fleet = ServerFleet(policy_dir, 1, "hf", TIMEOUT_S, restart=False)
    try:
        yield next(iter(fleet)).url, model
    finally:
        fleet.close()


@pytest.fixture
def connected(server):  # type: ignore[no-untyped-def]
    """A `WeightsyncTransfer` past `init_weight_transfer`, a client of the same server, the policy."""
    url, model = server
    transfer = WeightsyncTransfer([url], sender=SENDER)
    transfer.init_weight_transfer()
    try:
        with RolloutClient(url, timeout=TIMEOUT_S) as client:
            yield transfer, client, model
    finally:
        transfer.destroy()


@pytest.mark.slow
def test_the_protocol_round_against_a_server(connected) -> None:  # type: ignore[no-untyped-def]
    transfer, client, model = connected
    start = client.weight_info()["version"] or 0
    transfer.version = start  # a module-scoped server: go on from what it holds
    for version in (start + 1, start + 2):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.5)  # a training step: new weights each round
        transfer.pause()
        transfer.send_weights((name, p.detach()) for name, p in model.named_parameters())
        transfer.resume()
        info = client.weight_info()
        assert transfer.version == info["version"] == version
        assert info["content_digest"] == source_digest(ModuleSource(model))
        answer = client.completions(task.encode("3="), max_tokens=2, temperature=0)
        assert answer["choices"][0]["weight_version"] == version


@pytest.mark.slow
def test_a_push_the_server_refuses_raises(connected) -> None:  # type: ignore[no-untyped-def]
    transfer, client, _ = connected
    held = client.weight_info()["version"]
    transfer.version = held or 0
    transfer.pause()
    try:
        with pytest.raises(SyncFailed, match="did not commit"):
            transfer.send_weights(iter([("not.a.weight", torch.zeros(3))]))
    finally:
        transfer.resume()
    assert client.weight_info()["version"] == held


# --- A real GRPOTrainer run: the example at a small size ------------------------------------------


@pytest.mark.slow
def test_the_trl_example_trains_on_fresh_weights_and_leaves_them_on_the_servers(tmp_path: Path) -> None:
    steps = 3
    command = [sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--engine", "hf", "--steps", str(steps)]
    command += ["--prompts-per-step", "4", "--group", "4", "--timeout", str(TIMEOUT_S), "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    for record in records:  # every completion came from the weights of the step that trained on it
        assert record["sample_versions"] == [record["step"]]
        assert record["pushed_version"] == record["step"]
        assert record["receivers_committed"] == record["receivers"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    saved = source_digest(SafetensorsSource(tmp_path / "policy"))
    assert summary["trainer_digest"] == saved
    assert [s["content_digest"] for s in summary["servers"].values()] == [saved, saved]
    assert [s["version"] for s in summary["servers"].values()] == [steps, steps]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_docs_example_command_runs_as_written(tmp_path: Path) -> None:
    """The example as docs/integrations/trl.md (under its title, "# TRL: GRPO with weightsync
    rollout servers") and the README (under "## TRL") say it: two vLLM servers, 80 steps, in a
    checkout (here a folder whose examples/ is the checkout's, so the run writes there)."""
    from tests.doc_snippets import run_shell, shell_script, snippet

    doc = snippet("docs/integrations/trl.md", "# TRL: GRPO with weightsync rollout servers", 1)
    readme = snippet("README.md", "## TRL")
    assert readme.text == ".venv/bin/" + doc.text  # the same command, the README's from the checkout's venv
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for folder in (tmp_path / "bin", tmp_path / ".venv" / "bin"):  # `python` and `.venv/bin/python`: this one
        folder.mkdir(parents=True)
        (folder / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (folder / "python").chmod(0o755)
    done = run_shell(shell_script(doc, {}), cwd=tmp_path, path=tmp_path / "bin", timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    summary = json.loads((tmp_path / "runs" / "trl_grpo" / "summary.json").read_text())
    assert (summary["engine"], summary["steps"]) == ("vllm", 80)
    assert summary["reward_last_10pct"] > 0.8, summary  # the task learned, as the doc's figures say
    assert [s["content_digest"] for s in summary["servers"].values()] == [summary["trainer_digest"]] * 2


# --- The rollout function's own behaviour, with a stand-in for the trainer ------------------------


def stand_in_trainer(model: torch.nn.Module, policy_dir: Path, step: int) -> SimpleNamespace:
    """What the rollout function reads of a `GRPOTrainer`, for one process."""
    from transformers import AutoTokenizer

    return SimpleNamespace(
        state=SimpleNamespace(global_step=step),
        args=SimpleNamespace(max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, seed=0),
        processing_class=AutoTokenizer.from_pretrained(policy_dir),
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True, wait_for_everyone=lambda: None),
    )


def fleet_address(url: str) -> str:
    with RolloutClient(url, timeout=TIMEOUT_S) as client:
        [address] = client.weight_info()["addresses"]
    return str(address)


def test_identical_prompts_in_a_row_make_one_request_each_run() -> None:
    prompts = ["1=", "1=", "1=", "2=", "2=", "1="]  # a group split across processes ends a batch early
    groups = group_prompts(prompts, [task.encode(p) for p in prompts])
    assert [(g.start, g.size, g.prompt_ids) for g in groups] == [
        (0, 3, task.encode("1=")),
        (3, 2, task.encode("2=")),
        (5, 1, task.encode("1=")),
    ]


def test_every_completion_of_a_run_is_drawn_with_a_seed_of_its_own() -> None:
    """A server draws completion k of a request with its seed + k: no two completions of a batch,
    nor of two steps, may share a seed (shared seeds sample prompts with the same random numbers)."""
    prompts = [p for digit in range(8) for p in [task.prompt_text(digit)] * 8]
    groups = group_prompts(prompts, [task.encode(p) for p in prompts])
    seeds = [
        request_seed(0, step, group) + k  # type: ignore[operator]
        for step in range(50)
        for group in groups
        for k in range(group.size)
    ]
    assert len(set(seeds)) == len(seeds) == 50 * len(prompts)
    assert request_seed(None, 3, groups[0]) is None


@pytest.mark.slow
def test_a_server_that_dies_is_left_out_and_the_rollouts_go_on(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="weightsync")  # whatever level an earlier test left it at
    policy_dir = tmp_path / "policy"
    model = task.build_policy(policy_dir, seed=2)
    prompts = [p for digit in (1, 2, 3) for p in [task.prompt_text(digit)] * 4]
    fleet = ServerFleet(policy_dir, 2, "hf", TIMEOUT_S, restart=False)
    try:
        urls = [server.url for server in fleet]
        with WeightsyncRollout(urls, sender=SENDER) as rollout:
            first = rollout(prompts, stand_in_trainer(model, policy_dir, step=0))
            assert first["weight_version"] == [0] * len(prompts)
            assert [len(ids) for ids in first["prompt_ids"]] == [2] * len(prompts)
            assert "env_mask" not in first  # nothing stale
            fleet.kill(0)
            with torch.no_grad():
                model.model.embed_tokens.weight.add_(1.0)
            second = rollout(prompts, stand_in_trainer(model, policy_dir, step=1))
            assert second["weight_version"] == [1] * len(prompts)
            assert [len(ids) for ids in second["completion_ids"]] == [len(lp) for lp in second["logprobs"]]
            assert [c.base_url for c in rollout.servers.live] == [urls[1]]
            assert rollout.reports[-1].version == 1 and len(rollout.reports[-1].failed) == 1
            assert f"rollout server {urls[0]} did not commit version 1" in caplog.text
            third = rollout(prompts, stand_in_trainer(model, policy_dir, step=2))
            assert third["weight_version"] == [2] * len(prompts)
            assert [(o.address, o.committed) for o in rollout.reports[-1].outcomes] == [(fleet_address(urls[1]), True)]
            with RolloutClient(urls[1], timeout=TIMEOUT_S) as client:
                assert client.weight_info()["content_digest"] == source_digest(ModuleSource(model))
    finally:
        fleet.close()


@pytest.mark.slow
def test_completions_older_than_the_bound_are_kept_out_of_the_loss(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, model = server
    policy_dir = tmp_path / "policy"
    task.build_policy(policy_dir)  # the tokenizer the stand-in trainer reads
    prompts = [task.prompt_text(4)] * 3
    with RolloutClient(url, timeout=TIMEOUT_S) as client:
        pushed = (client.weight_info()["version"] or 0) + 1
    with WeightsyncRollout([url], max_staleness=1, sender=SENDER) as rollout:
        fresh = rollout(prompts, stand_in_trainer(model, policy_dir, step=pushed))
        assert fresh["weight_version"] == [pushed] * 3 and "env_mask" not in fresh
        rollout.version = pushed + 1  # as if pushed: the server still serves `pushed`, one behind
        within = rollout(prompts, stand_in_trainer(model, policy_dir, step=pushed + 1))
        assert within["weight_version"] == [pushed] * 3 and "env_mask" not in within
        rollout.version = pushed + 2  # two behind: past the bound
        stale = rollout(prompts, stand_in_trainer(model, policy_dir, step=pushed + 2))
        assert stale["weight_version"] == [pushed] * 3
        assert stale["env_mask"] == [[0] * len(ids) for ids in stale["completion_ids"]]


@pytest.mark.slow
def test_a_peft_model_is_pushed_as_its_adapter_and_generated_from_by_name(tmp_path: Path) -> None:
    """The base weights once, then only the adapter each step; every request names the adapter."""
    from peft import LoraConfig, get_peft_model

    from tests.server.conftest import live_server
    from weightsync.lora import adapter_from_peft

    policy_dir = tmp_path / "policy"
    base = task.build_policy(policy_dir, seed=3)
    base_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    prompts = [task.prompt_text(5)] * 4
    with live_server(policy_dir, engine="hf", max_lora_rank=8) as server:
        with WeightsyncRollout([server.url], sender=SENDER, adapter_name="grpo") as rollout:
            for step in (0, 1):
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if "lora_B" in name:
                            param.add_(0.1)  # a training step, as far as the servers can tell
                out = rollout(prompts, stand_in_trainer(model, policy_dir, step=step))
                assert out["weight_version"] == [step] * len(prompts)
                assert rollout.reports[-1].total_bytes < base_bytes / 20  # the adapter alone
            info = server.client.weight_info()
        (served,) = info["adapters"]
        tensors, _ = adapter_from_peft(model, "grpo")
        assert (served["name"], served["version"], info["version"]) == ("grpo", 1, 0)
        assert served["content_digest"] == source_digest(tensors)


TRL_DOC = ROOT / "docs" / "integrations" / "trl.md"


@pytest.mark.slow
def test_the_docs_grpo_program_runs_as_written(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """docs/integrations/trl.md's program, a whole one, against a real hf rollout server: TRL's
    GRPOTrainer trains two steps, and every generation is preceded by a push that commits."""
    import runpy
    import sys

    from tests.server.conftest import live_server

    text = TRL_DOC.read_text().split("## The lines that change in a TRL script", 1)[1]
    program = tmp_path / "grpo.py"
    program.write_text(text.split("```python\n", 1)[1].split("```\n", 1)[0])
    policy_dir = tmp_path / "policy"
    task.save_policy(task.build_policy(policy_dir), policy_dir)  # the trainer reads weights, the server none
    monkeypatch.chdir(tmp_path)
    with live_server(policy_dir) as server:
        monkeypatch.setattr(sys, "argv", [str(program), str(policy_dir), server.url])
        runpy.run_path(str(program), run_name="__main__")
        served = server.client.weight_info()["version"]
    # one push before each step's generation: the version is the trainer's global step
    assert capsys.readouterr().out.strip().splitlines()[-1] == "pushed versions: [0, 1]"
    assert served == 1
