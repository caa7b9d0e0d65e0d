"""An FSDP2 trainer for the sharded-sync tests: run by torchrun, every rank pushes its part.

    python -m torch.distributed.run --nproc-per-node 2 tests/integrations/fsdp_trainer.py \\
        --model DIR --out DIR (--vllm URL | --to ADDRESS ...) [--transport shm] [--versions 2]

Each rank loads the checkpoint at DIR (the same weights on every rank), shards it with FSDP2
(`init_device_mesh("cpu", (world,))`, `fully_shard` per decoder layer then the model, gloo),
then pushes it: through vLLM's trainer API (`--vllm`: every rank calls `trainer_init` and
`send_weights`, sharded) or with a `WeightSender` of its own (`--to`). A dense model goes as its
parameters (`ModuleSource(model, sharded=True)`, or vLLM's own `ModuleSource`), a
mixture-of-experts one in its checkpoint's names (`HFCheckpointSource(model, sharded=True)`).
Rank r writes what it saw to OUT/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vllm", default="")
    parser.add_argument("--to", nargs="*", default=[])
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--versions", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=96 << 10)
    parser.add_argument("--vllm-source", action="store_true", help="vLLM's own ModuleSource (dense)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = sharded_model(args.model)
    source = trainer_source(model, vllm_source=args.vllm_source)
    reports = push_to_vllm(args, source) if args.vllm else push_to(args, source)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(reports))
    dist.barrier()
    dist.destroy_process_group()


def sharded_model(path: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = AutoModelForCausalLM.from_pretrained(path)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trainer_source(model: torch.nn.Module, *, vllm_source: bool) -> object:
    from weightsync import HFCheckpointSource, ModuleSource

    if getattr(model.config, "num_experts", 0):
        return HFCheckpointSource(model, sharded=True)
    if vllm_source:
        from vllm.distributed.weight_transfer.base import ModuleSource as VLLMModuleSource

        return VLLMModuleSource(model)
    return ModuleSource(model, sharded=True)


def described(report: object) -> dict[str, object]:
    return {
        "ok": report.ok,  # type: ignore[attr-defined]
        "summary": report.summary(),  # type: ignore[attr-defined]
        "wire_bytes": {o.address: o.wire_bytes for o in report.outcomes},  # type: ignore[attr-defined]
        "whole_tensors": list(report.whole_tensors),  # type: ignore[attr-defined]
        "content_digest": report.content_digest,  # type: ignore[attr-defined]
    }


def push_to(args: argparse.Namespace, source: object) -> list[dict[str, object]]:
    from weightsync import WeightSender

    with WeightSender(args.to, timeout=60, bucket_bytes=args.bucket_bytes, verify="bucket") as sender:
        return [described(sender.push(source, version)) for version in range(1, args.versions + 1)]


def push_to_vllm(args: argparse.Namespace, source: object) -> list[dict[str, object]]:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync import SenderOptions
    from weightsync.integrations.vllm import VLLMSource, WeightsyncTrainerInitInfo

    if not hasattr(source, "_module") and not type(source).__name__.startswith("VLLM"):
        source = VLLMSource(source)  # type: ignore[arg-type]
    options = SenderOptions(verify="bucket", timeout=60, bucket_bytes=args.bucket_bytes)
    info = WeightsyncTrainerInitInfo(rank=dist.get_rank(), transport=args.transport, options=options, sharded=True)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(args.vllm, timeout=120), source=source
    )
    try:
        return [described(engine.send_weights()) for _ in range(args.versions)]
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
