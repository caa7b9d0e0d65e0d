"""`weightsync demo`: arguments, then the run, then the plot and the summary."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync.cli.args import DefaultsFormatter, at_least, positive_seconds
from weightsync.errors import ConfigError

if TYPE_CHECKING:
    from weightsync.demo.loop import DemoConfig

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = subparsers.add_parser(
        "demo",
        formatter_class=DefaultsFormatter,
        help="a real GRPO run that pushes weights to rollout engines after every step",
        description="Train a tiny policy with GRPO on a checkable task. Rollouts come from rollout "
        "engines (two `weightsync serve` processes by default), and the weights are pushed to them "
        "after every step. Writes steps.jsonl, reward_and_sync.png and summary.json to --out.",
    )
    demo.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        default="disaggregated",
        help="rollout servers in their own processes, or the engine in the trainer's process (inproc)",
    )
    demo.add_argument("--servers", type=at_least(1), default=2, help="rollout servers (disaggregated)")
    demo.add_argument(
        "--engine",
        choices=["auto", "hf", "vllm", "sglang"],
        default="auto",
        help="rollout servers' engine: auto is vllm where it is installed, else hf (default: auto); sglang runs "
        "from SGLang's own venv (scripts/install-sglang.sh DIR, then DIR/bin/weightsync demo --engine sglang)",
    )
    demo.add_argument("--steps", type=at_least(1), help="training steps (default: 80; 300 with --lora)")
    demo.add_argument("--prompts-per-step", type=at_least(1), default=16, help="prompts per training step")
    demo.add_argument("--group", type=at_least(2), default=8, help="samples per prompt")
    demo.add_argument("--lr", type=float, help="learning rate (default: 3e-3; 7e-3 with --lora)")
    demo.add_argument(
        "--final-lr-fraction",
        type=float,
        help="the learning rate falls linearly to lr x this by the last step (default: 1.0, constant; 0.1 with --lora)",
    )
    demo.add_argument(
        "--kl-coef", type=float, help=f"KL penalty to the initial policy (default: 0; {LORA_KL_COEF} with --lora)"
    )
    demo.add_argument("--max-staleness", type=at_least(0), default=1, help="drop samples more versions old")
    demo.add_argument("--kill-server-at", type=at_least(0), help="SIGKILL rollout server 0 at this step (resilience)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the policy, the prompts and the sampling")
    demo.add_argument("--timeout", type=positive_seconds, default=60.0, help="seconds any request or sync may take")
    demo.add_argument(
        "--startup-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="seconds each rollout server may take to start (default: 300 for hf, 600 for vllm: a busy host is slow)",
    )
    demo.add_argument("--out", type=Path, default=Path("runs/demo"), help="run directory")
    demo.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar over the steps"
    )
    demo.add_argument(
        "--delta",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="delta sync (delta=True): send servers on a network transport only what changed; the demo's "
        "servers share its host (shm), where every push goes whole (docs/delta.md)",
    )
    demo.add_argument("--delta-all", action="store_true", help="send only what changed over every transport (shm too)")
    demo.add_argument(
        "--wire-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the dtype the servers hold, each push casting the float32 policy to it; with --delta-all and --lr 1e-5 "
        "most bf16 weights keep their bits each step and the plot shows delta syncs (docs/delta.md)",
    )
    demo.add_argument(
        "--lora",
        action="store_true",
        help="train a LoRA adapter on the policy (its own weights frozen after a little pretraining on a neighbouring "
        "skill) and push only the adapter after every step; the servers serve it by name (docs/demo.md)",
    )
    demo.add_argument("--lora-rank", type=at_least(1), help=f"with --lora: the adapter's rank (default: {LORA_RANK})")
    demo.set_defaults(handler=run)


LORA_RANK = 4
"""Rank 4 on every linear layer: 11% of the policy's bytes. Rank 1 (3%) plateaued near 0.5 in
300 steps on hf (seed 0, 2026-11-28) where rank 4 learned the task (docs/demo.md)."""
LORA_PRETRAIN_STEPS = 300
"""Supervised batches of `task.pretrain` before a LoRA run: the base learns to add, not the task."""
LORA_KL_COEF = 0.05
"""The KL penalty to the initial policy under --lora. A group of samples all wrong has no
advantage to give, so without it an adapter drifting toward one answer for every prompt is
never pulled back on the prompts it stops answering right (seen: "6666666666" for the ten
digits); the penalty keeps those prompts near the base, which samples every digit."""


def choose_engine(engine: str, mode: str) -> str:
    """The rollout servers' engine: auto is vLLM where it is installed, else hf (said on stderr).

    Raises:
        ConfigError: --engine vllm where vLLM is not installed.
    """
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "--engine sglang: SGLang is not installed here; run scripts/install-sglang.sh DIR, "
            "then DIR/bin/weightsync demo --engine sglang"
        )
    installed = importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not installed:
        raise ConfigError("--engine vllm: vLLM is not installed here; run scripts/install-vllm.sh, or use --engine hf")
    if engine == "auto":
        engine = "vllm" if installed else "hf"
        if not installed and mode == "disaggregated":
            print(
                "weightsync demo: vLLM is not installed here (scripts/install-vllm.sh installs it): hf engine",
                file=sys.stderr,
            )
    return engine


STARTUP_S = {"hf": "10-30 s", "vllm": "30-120 s", "sglang": "60-180 s"}
"""How long starting the rollout servers took on the 2-core dev machine (imports, engine,
warm-up), idle to busy."""


def show_progress() -> None:
    """The demo's own log lines (a server still starting, one that failed) on stderr, as
    `weightsync demo: ...`; the servers' logs go to files in the run directory."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("weightsync demo: %(message)s"))
    demo_log = logging.getLogger("weightsync.demo")
    demo_log.addHandler(handler)
    demo_log.setLevel(logging.INFO)
    demo_log.propagate = False


def demo_config(args: argparse.Namespace, engine: str) -> DemoConfig:
    """The run `args` ask for, with --lora's own defaults where a flag is left out.

    Raises:
        ConfigError: --lora-rank without --lora.
    """
    from weightsync.demo.loop import DemoConfig

    if args.lora_rank is not None and not args.lora:
        raise ConfigError("--lora-rank applies to a LoRA run: add --lora")
    lora = bool(args.lora)
    return DemoConfig(
        mode=args.mode,
        servers=args.servers,
        engine=engine,
        steps=args.steps if args.steps is not None else (300 if lora else 80),
        prompts_per_step=args.prompts_per_step,
        group=args.group,
        lr=args.lr if args.lr is not None else (7e-3 if lora else 3e-3),
        kl_coef=args.kl_coef if args.kl_coef is not None else (LORA_KL_COEF if lora else 0.0),
        final_lr_fraction=args.final_lr_fraction if args.final_lr_fraction is not None else (0.1 if lora else 1.0),
        max_staleness=args.max_staleness,
        seed=args.seed,
        out=args.out,
        timeout=args.timeout,
        startup_timeout=args.startup_timeout,
        kill_server_at=args.kill_server_at,
        progress=args.progress,
        delta="all" if args.delta_all else args.delta,
        wire_dtype=args.wire_dtype,
        lora_rank=(args.lora_rank or LORA_RANK) if lora else 0,
        pretrain_steps=LORA_PRETRAIN_STEPS if lora else 0,
    )


def run(args: argparse.Namespace) -> int:
    from weightsync.demo.loop import run as run_loop

    engine = choose_engine(args.engine, args.mode)
    config = demo_config(args, engine)
    steps, lora_rank = config.steps, config.lora_rank
    served_by = engine if args.mode == "disaggregated" else "hf"  # colocated: an hf engine in this process
    if args.mode == "disaggregated":
        print(
            f"weightsync demo: starting {args.servers} rollout servers on the {engine} engine "
            f"(about {STARTUP_S[engine]}; their logs: {args.out}/server-*.log), then {steps} GRPO steps"
            + (f" training a rank-{lora_rank} LoRA adapter" if lora_rank else ""),
            file=sys.stderr,
            flush=True,
        )
    show_progress()
    started = time.perf_counter()
    try:
        records = run_loop(config)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM: the steps done get their plot and summary
        done = read_steps(args.out / "steps.jsonl")
        if done:
            write_report(args, done, time.perf_counter() - started, served_by, interrupted=True)
        raise
    write_report(args, records, time.perf_counter() - started, served_by)
    print(f"  trained policy: {args.out / 'policy'} (serve it, push it, check it: see README, 'Next')")
    return 0


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The steps a run recorded (steps.jsonl, one object a line; a line cut short by the
    interruption is left out)."""
    records = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def write_report(
    args: argparse.Namespace,
    records: list[dict[str, Any]],
    seconds: float,
    served_by: str,
    *,
    interrupted: bool = False,
) -> None:
    """The plot, summary.json and the summary's lines on stdout, for the steps in `records`."""
    from weightsync.demo.report import plot, summary

    plot(records, args.out / "reward_and_sync.png", engine=served_by, mode=args.mode)
    result = summary(records) | {"seconds": seconds, "mode": args.mode, "engine": served_by}
    result["interrupted"] = interrupted
    (args.out / "summary.json").write_text(json.dumps(result, indent=1))
    ended = f"interrupted after {result['steps']} steps" if interrupted else f"{result['steps']} steps"
    print(
        f"weightsync demo ({args.mode}, {served_by} engine): {ended} in {result['seconds']:.0f} s; "
        f"reward {result['reward_first_10pct']:.2f} (first 10% of steps) -> {result['reward_last_10pct']:.2f} "
        f"(last 10%); {result['syncs']} syncs of the {result['pushes']}, mean {result['mean_sync_seconds'] * 1e3:.1f} "
        f"ms, median {result['median_sync_bytes'] / 1024:.1f} KiB pushed ({result['median_sync_fraction']:.1%} of the "
        f"model's bytes), {result['median_wire_bytes'] / 1024:.1f} KiB on the wire; "
        f"max version lag {result['max_version_lag']}, "
        f"{result['dropped_stale']} samples dropped as stale",
        flush=True,
    )
    for event in result["events"]:
        print(f"  {event}")
    print(f"  run directory: {args.out} (steps.jsonl, reward_and_sync.png, summary.json)", flush=True)
