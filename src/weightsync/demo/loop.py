"""The demo's training loop: sample from the rollout engines, score, GRPO step, push, repeat.

Disaggregated (default): the rollout servers generate the next batch while the trainer trains
on the current one (one-step off-policy); once both are done, the new weights are pushed to
every server, so no request is in flight during the transfer. Colocated: generate, train and
push in turn, through `inproc`, in one process.

    step k:  train on samples of version k-1 (k in colocated mode)  -> version k+1 -> push
             servers: generate step k+1's samples on version k ----^
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from weightsync.demo import grpo, task
from weightsync.demo.report import StepLog
from weightsync.demo.rollouts import STARTUP_TIMEOUT_S, FleetOptions, LocalRollouts, Request, Sample, ServerFleet
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError
from weightsync.lora import Adapter, adapter_from_peft, base_from_peft
from weightsync.module_source import ModuleSource
from weightsync.options import Delta
from weightsync.report import SyncReport

__all__ = ["DemoConfig", "run"]

log = logging.getLogger(__name__)

DemoMode = Literal["disaggregated", "colocated"]
Rollouts = LocalRollouts | ServerFleet


@dataclasses.dataclass(frozen=True, slots=True)
class DemoConfig:
    """Everything a run depends on; the defaults learn the task (reward above 0.8) in about 60 steps."""

    mode: DemoMode = "disaggregated"
    servers: int = 2
    engine: str = "hf"
    steps: int = 80
    prompts_per_step: int = 16
    group: int = 8
    lr: float = 3e-3
    kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (0: none). It keeps the prompts a run does
    not answer right yet near where it started, still sampling their right answers: a group
    whose samples are all wrong gives no advantage to pull them back."""
    max_staleness: int = 1
    seed: int = 0
    out: Path = Path("runs/demo")
    timeout: float = 60.0
    """Seconds any request or sync may take."""
    startup_timeout: float | None = None
    """Seconds each rollout server may take to start (None: the engine's `STARTUP_TIMEOUT_S`,
    generous: a vLLM server alone takes 54-90 s on a busy 2-core host)."""
    kill_server_at: int | None = None
    progress: bool = True
    delta: Delta = False
    """`WeightSender`'s `delta`: a server on a network transport (True) or on any ("all") gets
    only the elements that changed, where that is less than half the model (docs/delta.md). The
    demo's servers are on shm, where True sends every push whole (the sender says so, once); at
    this learning rate nearly every weight moves every step, so even "all" mostly goes full;
    steps.jsonl records what each push moved."""
    wire_dtype: str = "float32"
    """The dtype the servers hold and each push casts the float32 policy to. At "bfloat16" and a
    learning rate of 1e-5 most weights keep their bf16 bits from step to step, so a delta push
    (`delta="all"`) carries a patch: `weightsync demo --delta-all --wire-dtype bfloat16 --lr 1e-5`."""
    final_lr_fraction: float = 1.0
    """The learning rate falls linearly from `lr` at the first step to `lr` x this at the last
    (1.0: constant). Adam's steps keep their size however small the gradient, so once nearly
    every group is all correct (no signal) a constant rate walks the policy off what it learned:
    a LoRA run at 7e-3 reached 0.97 near step 220 of 300, then collapsed to 0.47."""
    lora_rank: int = 0
    """Train a LoRA adapter of this rank on every linear layer of the policy, whose own weights
    stay frozen, and push only the adapter after each step (0: train and push the whole policy)."""
    pretrain_steps: int = 0
    """Before anything is pushed, pretrain the policy on a neighbouring skill and the answer's
    form, never on the task (`task.pretrain`: its reward stays at chance or below); the LoRA
    demo's base needs it."""


ADAPTER = "policy-lora"
"""The name the demo's LoRA adapter is served under: every request names it. Not "policy": the
servers serve the base model under its folder's name, and refuse an adapter that takes it."""

LORA_ALPHA_PER_RANK = 2
"""lora_alpha = 2 x rank, PEFT's and vLLM's usual scale."""


STEPS_PER_SEED = 1_000_000
"""Runs of different `seed`s draw their samples' seeds from ranges this many steps apart."""


OnStep = Callable[[dict[str, Any], torch.nn.Module, Rollouts], None]


def run(config: DemoConfig, on_step: OnStep | None = None) -> list[dict[str, Any]]:
    """Train for `config.steps` steps; returns the per-step records (also in steps.jsonl)."""
    torch.set_num_threads(1)  # the rollout servers need the other core
    config.out.mkdir(parents=True, exist_ok=True)
    model_dir = config.out / "policy"
    policy = task.build_policy(model_dir, seed=config.seed, served_dtype=config.wire_dtype)
    if config.pretrain_steps:
        task.pretrain(policy, config.pretrain_steps, seed=config.seed)
    model: torch.nn.Module = policy  # under LoRA, PEFT's model over it
    reference = copy.deepcopy(model).requires_grad_(False) if config.kl_coef > 0 else None  # the initial policy
    rng = random.Random(config.seed)
    steps: StepLog | None = None
    rollouts = start_rollouts(config, model_dir)  # stops what it started if it fails
    pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-demo-rollouts")
    bar = tqdm(total=config.steps, disable=not config.progress, unit="step", file=None)
    try:
        steps = StepLog(config.out / "steps.jsonl")
        push(rollouts, model, 0)  # version 0: the initial weights
        if config.lora_rank:  # the base stays as pushed; from here on, only the adapter moves
            model = with_adapter(model, config.lora_rank)
            push(rollouts, model, 0)  # the adapter's version 0: the base's output
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, config=config))
        model_bytes = distinct_bytes(model_weights(model))
        samples = rollouts.generate(new_request(config, rng, 0))
        for step in range(config.steps):
            if step == config.kill_server_at and isinstance(rollouts, ServerFleet):
                rollouts.kill(0)
            next_batch = None
            if config.mode == "disaggregated":  # the servers generate step+1 while this step trains
                next_batch = pool.submit(rollouts.generate, new_request(config, rng, step + 1))
            used, dropped = fresh(samples, version=step, max_staleness=config.max_staleness)
            rewards = [task.reward(task_digit(s), s.completion_ids) for s in used]
            train_step(model, reference, optimizer, used, rewards, config)
            schedule.step()
            if next_batch is not None:  # push only once no request is in flight: a pure transfer
                samples = next_batch.result(timeout=config.timeout * 4)
            rollouts.check_alive()
            report = push(rollouts, model, step + 1)
            if next_batch is None:
                samples = rollouts.generate(new_request(config, rng, step + 1))
            record: dict[str, Any] = {
                "step": step,
                "reward_mean": sum(rewards) / max(len(rewards), 1),
                "sync_seconds": report.seconds,
                "sync_gbps": report.gbps,
                "sync_bytes": report.total_bytes,
                "model_bytes": model_bytes,
                "adapter": ADAPTER if config.lora_rank else None,
                "wire_bytes": report.wire_bytes,
                "changed_fraction": report.changed_fraction,
                "sync_modes": sorted({o.mode for o in report.outcomes if o.committed}),
                "weight_version": step + 1,
                "sample_versions": sorted({s.weight_version for s in used}),
                "max_version_lag": max((step - s.weight_version for s in used), default=0),
                "samples": len(used),
                "dropped_stale": dropped,
                "receivers_committed": len(report.outcomes) - len(report.failed),
                "receivers": len(report.outcomes),
                "events": rollouts.events[:],
            }
            rollouts.events.clear()
            steps.write(record)
            for event in record["events"]:
                bar.write(f"step {step}: {event}")
            bar.set_postfix(
                reward=f"{record['reward_mean']:.2f}",
                sync=f"{record['sync_seconds'] * 1e3:.0f}ms",
                lag=record["max_version_lag"],
            )
            bar.update(1)
            if on_step is not None:
                on_step(record, model, rollouts)
        save(model, config)
        return steps.records
    finally:  # the servers first: requests in flight then fail at once, and no thread waits on them
        bar.close()
        rollouts.close()
        pool.shutdown(wait=True, cancel_futures=True)
        if steps is not None:
            steps.close()


def start_rollouts(config: DemoConfig, model_dir: Path) -> Rollouts:
    if config.mode == "colocated":
        return LocalRollouts(model_dir, config.timeout, config.lora_rank, config.delta, _cast(config))
    if config.mode == "disaggregated":
        startup_timeout = config.startup_timeout or STARTUP_TIMEOUT_S[config.engine]
        options = FleetOptions(startup_timeout=startup_timeout, max_lora_rank=config.lora_rank, log_dir=config.out)
        fleet = (model_dir, config.servers, config.engine, config.timeout, options)
        return ServerFleet(*fleet, delta=config.delta, cast=_cast(config))
    raise ConfigError(f"mode must be 'disaggregated' or 'colocated', got {config.mode!r}")


def _cast(config: DemoConfig) -> torch.dtype | None:
    """What each push casts the float32 policy to (`DemoConfig.wire_dtype`): None, nothing."""
    return None if config.wire_dtype == "float32" else dtype_from_name(config.wire_dtype)


def with_adapter(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` under a fresh PEFT LoRA adapter of `rank` on every linear layer (its B is zero, so
    it generates what `model` does); only the adapter trains."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA_PER_RANK * rank, target_modules="all-linear")
    return get_peft_model(model, config)


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's own weights (under an adapter: the base's, in the base's names)."""
    return base_from_peft(model) if hasattr(model, "peft_config") else dict(model.state_dict())


def lr_factor(step: int, config: DemoConfig) -> float:
    """The learning rate at `step`, as a fraction of `config.lr`: linear to `final_lr_fraction`."""
    progress = step / max(config.steps - 1, 1)
    return 1.0 + (config.final_lr_fraction - 1.0) * min(progress, 1.0)


def distinct_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes of `tensors`, each memory counted once: a tied `lm_head` is the embedding, and
    a push sends it once."""
    return sum({(t.data_ptr(), t.nbytes): t.nbytes for t in tensors.values()}.values())


def save(model: Any, config: DemoConfig) -> None:
    """The trained policy at out/policy, next to the config the servers read; under LoRA, the
    base there and the adapter, as PEFT saves it, at out/adapter."""
    if not hasattr(model, "peft_config"):
        task.save_policy(model, config.out / "policy")
        return
    model.save_pretrained(config.out / "adapter")
    task.save_policy(model.unload(), config.out / "policy")  # the base, its own layers back in place


def new_request(config: DemoConfig, rng: random.Random, step: int) -> Request:
    digits = task.sample_digits(rng, config.prompts_per_step)
    prompts = [task.encode(task.prompt_text(d)) for d in digits]
    # Every sample of the run its own seed (Request.seed): seeds that steps shared would sample
    # a prompt with the same random numbers step after step, and it would explore no further.
    seed = (config.seed * STEPS_PER_SEED + step) * config.prompts_per_step * config.group
    adapter = ADAPTER if config.lora_rank else None
    return Request(prompts, config.group, task.ANSWER_LENGTH, temperature=1.0, seed=seed, adapter=adapter)


def task_digit(sample: Sample) -> int:
    return int(task.decode(sample.prompt_ids[:1]))


def fresh(samples: list[Sample], version: int, max_staleness: int) -> tuple[list[Sample], int]:
    """The samples at most `max_staleness` versions behind `version`, and how many were not."""
    kept = [s for s in samples if version - s.weight_version <= max_staleness]
    return kept, len(samples) - len(kept)


def push(rollouts: Rollouts, model: torch.nn.Module, version: int) -> SyncReport:
    """Push the model (under an adapter: the adapter alone) to every rollout engine; a restarted
    server gets the base weights first, for the adapter to sit on."""
    tensors, adapter = payload(model)
    base = base_from_peft(model) if adapter is not None else None
    return rollouts.push(tensors, version, adapter=adapter, base=base)


def payload(model: torch.nn.Module) -> tuple[Any, Adapter | None]:
    """What a push sends: the whole model, or the adapter alone (PEFT's names) and its shape."""
    if hasattr(model, "peft_config"):
        return adapter_from_peft(model, ADAPTER)
    return ModuleSource(model), None


def train_step(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: list[float],
    config: DemoConfig,
) -> None:
    """One GRPO update on `samples` (one optimizer step over the whole batch)."""
    if not samples:
        return
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    inputs = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width - 1)
    old = torch.zeros(len(samples), width - 1)
    for row, sample in enumerate(samples):
        ids = sample.prompt_ids + sample.completion_ids
        inputs[row, : len(ids)] = torch.tensor(ids)
        start, end = len(sample.prompt_ids) - 1, len(ids) - 1  # positions predicting the completion
        mask[row, start:end] = 1
        old[row, start:end] = torch.tensor(sample.logprobs, dtype=torch.float32)
    advantages = grpo.group_advantages(torch.tensor(rewards), torch.tensor([s.prompt_index for s in samples]))
    logprobs = token_logprobs(model, inputs)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = token_logprobs(reference, inputs)
    loss = grpo.policy_loss(logprobs, old, advantages, mask, ref_logprobs=ref, kl_coef=config.kl_coef)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def token_logprobs(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """[batch, width - 1]: the logprob of each next token under `model`."""
    logits = model(input_ids=inputs).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, inputs[:, 1:, None])[..., 0]
