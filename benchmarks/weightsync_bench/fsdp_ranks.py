"""An FSDP2 trainer whose ranks push: run by torchrun, for bench_sharded.py and the tests.

    python -m torch.distributed.run --nproc-per-node 2 -m weightsync_bench.fsdp_ranks \\
        --model DIR --out DIR (--vllm URL | --to ADDRESS ...) [--mode sharded|full] [--versions N] [--delta]

Each rank loads the checkpoint at DIR (the same weights on every rank) and shards it with FSDP2
(`init_device_mesh("cpu", (world,))`, `fully_shard` per decoder layer then the model, gloo).
Then it pushes `--versions` times:

- `--mode sharded`: every rank pushes the rows it holds. `--vllm`: every rank calls vLLM's
  trainer API (`trainer_init`, `send_weights`) with `WeightsyncTrainerInitInfo(sharded=True)`;
  `--to`: every rank has a `WeightSender` of its own.
- `--mode full`: today's push, for comparison: every rank gathers each tensor whole
  (`full_tensor()`), rank 0 sends whole tensors and the other ranks walk the source in step.

A dense model goes as its parameters (vLLM's own `ModuleSource` with `--vllm-source`, else
weightsync's), a mixture-of-experts one in its checkpoint's names (`HFCheckpointSource`).
Rank r writes OUT/rank{r}.json: per push, whether it committed (or what it raised), its
seconds, the bytes each worker was sent by this rank, the tensors sent whole, and how much this
process's peak RSS grew during it (`PeakRss`); and the bytes of the shard this rank holds.

`--delta`: the pushes carry deltas (`SenderOptions(delta=True)`), and before every push but the
first the trainer steps (`train_step`: about 3% of every parameter's elements move, the same
whatever the sharding, so that a test can make the weights it must end with).

`--rank1-dies` (a fault, with `--vllm`): rank 1's process exits while it pushes the last
version, after vLLM's update window opened (it has written its file first).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightsync_bench.measure import PeakRss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vllm", default="")
    parser.add_argument("--to", nargs="*", default=[])
    parser.add_argument("--mode", choices=["sharded", "full"], default="sharded")
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--versions", type=int, default=1)
    parser.add_argument("--first-version", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=96 << 10)
    parser.add_argument("--vllm-source", action="store_true", help="vLLM's own ModuleSource (dense)")
    parser.add_argument("--rank1-dies", action="store_true", help="rank 1 exits while it pushes the last version")
    parser.add_argument("--delta", action="store_true", help="delta pushes, a training step before each but the first")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = sharded_model(args.model)
    shard = sum(p.to_local().nbytes for p in model.parameters())  # type: ignore[attr-defined]
    source = trainer_source(model, sharded=args.mode == "sharded", vllm_source=args.vllm_source)
    pushes: list[dict[str, Any]] = []

    def write() -> None:
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({"pushes": pushes, "shard_bytes": shard}))

    if args.rank1_dies and rank == 1:
        dies_while_sending(source, push=args.versions, write=write)
    pushes += push_to_vllm(args, source, model) if args.vllm else push_to(args, source, model)
    write()
    if all(push["ok"] for push in pushes):  # else a rank is gone: no one to meet
        dist.barrier()
        dist.destroy_process_group()


def sharded_model(path: str) -> torch.nn.Module:
    """The checkpoint at `path`, sharded by FSDP2 over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = AutoModelForCausalLM.from_pretrained(path)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trainer_source(model: Any, *, sharded: bool, vllm_source: bool) -> Any:
    from weightsync import HFCheckpointSource, ModuleSource

    if getattr(model.config, "num_experts", 0):
        return HFCheckpointSource(model, sharded=sharded)
    if vllm_source:
        from vllm.distributed.weight_transfer.base import ModuleSource as VLLMModuleSource

        return VLLMModuleSource(model)
    return ModuleSource(model, sharded=sharded)


def train_step(model: torch.nn.Module, step: int) -> None:
    """Move about 3% of the elements of every parameter of `model` (plain or sharded by FSDP2's
    `Shard(0)`) by 0.01, chosen by `step`: the same weights whatever the sharding."""
    with torch.no_grad():
        for index, (_, param) in enumerate(model.named_parameters()):
            gen = torch.Generator().manual_seed(step * 1009 + index)
            moved = (torch.rand(tuple(param.shape), generator=gen) < 0.03).to(param.dtype) * 0.01
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:  # a DTensor: this rank's rows (`torch.chunk`'s cut)
                size = -(-param.shape[0] // mesh.size())
                first = mesh.get_local_rank() * size
                param.to_local().add_(moved[first : first + size])  # type: ignore[attr-defined]
            else:
                param.add_(moved)


def stepped(model: torch.nn.Module | None, push: Any, step: int, delta: bool) -> Any:
    """`push`, after a training step where the pushes carry deltas (and this one is not the first)."""
    if model is not None and delta and step:
        train_step(model, step)
    return push


def dies_while_sending(source: Any, push: int, write: Any) -> None:
    """Make this process exit once `source` has given its second tensor of its `push`-th push
    (`write` first): a trainer rank that crashes in the middle of a sharded push."""
    from weightsync.source import ShardedSource

    assert isinstance(source, ShardedSource), "a weightsync source that shards"
    held, laid_out = source.held, source.layout
    started = [0]  # pushes begun: each calls `layout` once, before it walks `held`

    def layout() -> Any:
        started[0] += 1
        return laid_out()

    def walked() -> Any:
        for index, item in enumerate(held()):
            if started[0] == push and index == 1:
                write()
                os._exit(0)
            yield item

    source.layout = layout  # type: ignore[method-assign]
    source.held = walked  # type: ignore[method-assign]


def measured(push: Any) -> dict[str, Any]:
    """One push, timed, with this process's peak RSS growth over it (or what it raised)."""
    from weightsync.errors import one_line

    peak = PeakRss()
    peak.start()
    started = time.perf_counter()
    try:
        report = push()
    except Exception as exc:
        peak.stop()
        seconds = time.perf_counter() - started
        return {"ok": False, "seconds": seconds, "error": f"{type(exc).__name__}: {one_line(exc)}"}
    seconds = time.perf_counter() - started
    added = peak.stop()
    if report is None:  # a rank that only walks the source (a full push's other ranks)
        return {"ok": True, "seconds": seconds, "peak_rss_added": added, "wire_bytes": {}, "whole_tensors": []}
    return {
        "ok": report.ok,
        "seconds": seconds,
        "peak_rss_added": added,
        "summary": report.summary(),
        "wire_bytes": {outcome.address: outcome.wire_bytes for outcome in report.outcomes},
        "modes": {outcome.address: outcome.mode for outcome in report.outcomes},
        "content_digest": report.content_digest,
        "whole_tensors": list(report.whole_tensors),
    }


def push_to(args: argparse.Namespace, source: Any, model: torch.nn.Module | None = None) -> list[dict[str, Any]]:
    """`--versions` pushes of `source` by a `WeightSender` to `--to`; with `--delta`, `model`
    steps between them (`stepped`)."""
    from weightsync import WeightSender

    delta = model is not None and args.delta
    options = {"timeout": 60, "bucket_bytes": args.bucket_bytes, "verify": "bucket", "delta": delta}
    with WeightSender(args.to, **options) as sender:
        return [
            measured(stepped(model, lambda v=version: sender.push(source, v), step, delta))
            for step, version in enumerate(range(args.first_version, args.first_version + args.versions))
        ]


def push_to_vllm(args: argparse.Namespace, source: Any, model: torch.nn.Module | None = None) -> list[dict[str, Any]]:
    """`--versions` pushes of `source` through vLLM's trainer API at `--vllm`; with `--delta`,
    `model` steps between them (`stepped`)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync import SenderOptions
    from weightsync.integrations.vllm import VLLMSource, WeightsyncTrainerInitInfo
    from weightsync.source import WeightSource

    if isinstance(source, WeightSource):
        source = VLLMSource(source)
    delta = model is not None and args.delta
    options = SenderOptions(verify="bucket", timeout=120, bucket_bytes=args.bucket_bytes, delta=delta)
    sharded = args.mode == "sharded"
    info = WeightsyncTrainerInitInfo(rank=dist.get_rank(), transport=args.transport, options=options, sharded=sharded)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(args.vllm, timeout=300), source=source
    )
    try:
        return [
            measured(stepped(model, lambda v=version: engine.send_weights(version=v), step, delta))
            for step, version in enumerate(range(args.first_version, args.first_version + args.versions))
        ]
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
