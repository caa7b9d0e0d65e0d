"""TRL's GRPOTrainer on the demo's task, its rollouts from two `weightsync serve` servers.

    .venv/bin/pip install -e '.[trl]'          # once, in a weightsync checkout
    .venv/bin/python examples/trl_grpo.py                # vLLM servers (scripts/install-vllm.sh)
    .venv/bin/python examples/trl_grpo.py --engine hf    # transformers servers: quicker to start

A tiny Qwen2-shaped policy built from a config (the demo's) trains from scratch to write, after a
digit d and "=", the digit d + 1 four times. The servers start on dummy weights; before every
generation the trainer's weights are pushed to both (`WeightsyncRollout`), so every completion
comes from the weights of the step that asked for it. The run writes, under --out: steps.jsonl
(one line per step: TRL's metrics, the weight versions of its completions, the push's bytes and
seconds), summary.json (reward first and last 10% of steps, the servers' content digest against
the trainer's) and the trained policy, policy/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

from weightsync.client import RolloutClient
from weightsync.demo import task
from weightsync.demo.rollouts import ServerFleet
from weightsync.digest import source_digest
from weightsync.integrations.trl import WeightsyncRollout, log_weight_versions
from weightsync.module_source import ModuleSource
from weightsync.options import SenderOptions


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL: we know
    with warnings.catch_warnings():  # TRL warns, as it loads, about a vLLM newer than it; its vLLM code is not used
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
        from trl import GRPOTrainer
    torch.set_num_threads(1)  # the rollout servers need the other core
    args.out.mkdir(parents=True, exist_ok=True)
    policy_dir = args.out / "policy"
    model = task.build_policy(policy_dir, seed=args.seed)  # config and tokenizer for the servers, no weights
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    started = time.monotonic()
    fleet = ServerFleet(policy_dir, args.servers, args.engine, args.timeout, restart=False)
    try:
        urls = [server.url for server in fleet]
        print(f"trl_grpo: {len(urls)} {args.engine} servers up in {time.monotonic() - started:.0f} s", flush=True)
        with WeightsyncRollout(urls, sender=SenderOptions(timeout=args.timeout, verify="bucket")) as rollout:
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=log_weight_versions(reward),
                args=grpo_config(args),
                train_dataset=prompts_dataset(args),
                processing_class=tokenizer,
                rollout_func=rollout,
                callbacks=[StepLog(args.out / "steps.jsonl", rollout)],
            )
            trainer.remove_callback(PrinterCallback)  # StepLog prints one line per step instead
            trainer.train()
            # The last optimizer step's weights: pushed, so the servers serve the trained policy.
            rollout.push(trainer, trainer.state.global_step)
            task.save_policy(model, policy_dir)
            summary = summarize(args.out / "steps.jsonl", model, urls, args)
    finally:
        fleet.close()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="the rollout servers' engine")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (TRL's num_generations)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any start-up, request or push may take")
    parser.add_argument("--out", type=Path, default=Path("runs/trl_grpo"))
    return parser.parse_args(argv)


def grpo_config(args: argparse.Namespace) -> Any:
    """One generation and one optimizer step per step, as in the demo: prompts_per_step prompts,
    `group` completions each, four tokens long; no reference model (beta 0)."""
    from trl import GRPOConfig  # loaded by main()

    batch = args.prompts_per_step * args.group
    return GRPOConfig(
        output_dir=str(args.out / "trainer"),
        use_vllm=False,  # TRL does no sync of its own: the rollout function pushes
        use_cpu=True,
        max_steps=args.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group,
        max_completion_length=task.ANSWER_LENGTH,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        warmup_steps=0,
        beta=0.0,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def prompts_dataset(args: argparse.Namespace) -> Dataset:
    """Enough random digits for every step; the digit rides along to the reward function."""
    rng = random.Random(args.seed)
    digits = task.sample_digits(rng, args.steps * args.prompts_per_step)
    return Dataset.from_dict({"prompt": [task.prompt_text(d) for d in digits], "digit": digits})


SAMPLE_VERSIONS: dict[int, list[int]] = {}
"""Per trainer step, the weight versions of the completions it scored (steps.jsonl records them)."""


def reward(
    completions: list[str],
    completion_ids: list[list[int]],
    digit: list[int],
    weight_version: list[int],
    trainer_state: Any,
    **kwargs: Any,
) -> list[float]:
    """The demo's reward: a quarter for each of the four answer positions that is right.
    `weight_version` is the rollout function's: the weights that produced each completion."""
    SAMPLE_VERSIONS[trainer_state.global_step] = sorted(set(weight_version))
    return [task.reward(d, ids) for d, ids in zip(digit, completion_ids, strict=True)]


class StepLog(TrainerCallback):
    """steps.jsonl: per optimizer step, TRL's logged metrics, the step's push and the weight
    versions of the completions it trained on (from the rollout's last result)."""

    def __init__(self, path: Path, rollout: WeightsyncRollout) -> None:
        self.path, self.rollout = path, rollout
        self.path.write_text("")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "reward" not in logs:
            return
        report = self.rollout.reports[-1]
        step = state.global_step - 1  # the step that trained on these completions
        record = {
            "step": step,
            "reward_mean": logs["reward"],
            "sample_versions": SAMPLE_VERSIONS.pop(step),
            "pushed_version": report.version,
            "sync_seconds": report.seconds,
            # the slowest server's time in its engine's own reload, and parked waiting for requests
            "sync_load_seconds": max((o.times.load_s for o in report.outcomes if o.times), default=None),
            "sync_pause_seconds": max((o.times.pause_s for o in report.outcomes if o.times), default=None),
            "sync_bytes": report.total_bytes,
            "receivers_committed": len(report.outcomes) - len(report.failed),
            "receivers": len(report.outcomes),
        }
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
        print(
            f"step {step}: reward {record['reward_mean']:.2f}, completions of version "
            f"{record['sample_versions']}, push {report.seconds * 1e3:.0f} ms",
            flush=True,
        )


def summarize(steps_path: Path, model: torch.nn.Module, urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    records = [json.loads(line) for line in steps_path.read_text().splitlines()]
    tenth = max(1, len(records) // 10)
    servers = {}
    for url in urls:
        with RolloutClient(url, timeout=args.timeout) as client:
            info = client.weight_info()
        servers[url] = {"version": info["version"], "content_digest": info["content_digest"]}
    return {
        "engine": args.engine,
        "steps": len(records),
        "reward_first_10pct": sum(r["reward_mean"] for r in records[:tenth]) / tenth,
        "reward_last_10pct": sum(r["reward_mean"] for r in records[-tenth:]) / tenth,
        "sync_seconds_median": sorted(r["sync_seconds"] for r in records)[len(records) // 2] if records else None,
        "trainer_digest": source_digest(ModuleSource(model)),
        "servers": servers,
    }


if __name__ == "__main__":
    sys.exit(main())
