"""A Megatron-Core trainer whose ranks push: run by torchrun, for bench_megatron.py and the tests.

    python -m torch.distributed.run --nproc-per-node 2 -m weightsync_bench.megatron_ranks \\
        --model DIR --out DIR --tp 2 --pp 1 --ep 1 (--vllm URL | --to ADDRESS ...) [--mode sharded|gather]

Each rank builds its `GPTModel` shard on CPU (gloo, tests/megatron_cpu.py's test-only patches)
and loads its part of the checkpoint at DIR into it. Then it pushes once:

- `--mode sharded`: every rank pushes its boxes of the checkpoint tensors (`MegatronSource`),
  through a `WeightSender` of its own (`--to`) or vLLM's trainer API (`--vllm`).
- `--mode gather` (tensor parallel only): what a bridge's export does, for comparison: every
  rank all-gathers each parameter and converts it to checkpoint tensors, rank 0 pushes them
  whole (one `WeightSender`), the other ranks gather in step.

Rank r writes OUT/rank{r}.json: its push (`fsdp_ranks.measured`: ok, seconds, peak RSS growth,
bytes each receiver was sent) and the bytes of the shard it holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightsync_bench.fsdp_ranks import measured, push_to, push_to_vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.megatron_cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--vllm", default="")
    parser.add_argument("--to", nargs="*", default=[])
    parser.add_argument("--mode", choices=["sharded", "gather"], default="sharded")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=96 << 10)
    args = parser.parse_args()
    args.first_version, args.versions = args.version, 1

    from safetensors.torch import load_file
    from tests.megatron_cpu import build, load_checkpoint
    from transformers import AutoConfig

    from weightsync.integrations.megatron import MegatronSource

    dist.init_process_group("gloo")
    model = build(AutoConfig.from_pretrained(args.model), args.tp, args.pp, args.ep)
    load_checkpoint(model, load_file(Path(args.model, "model.safetensors")))
    shard = sum(param.nbytes for param in model.parameters())
    if args.mode == "sharded":
        source = MegatronSource(model)
        pushes = push_to_vllm(args, source) if args.vllm else push_to(args, source)
    else:
        pushes = [measured(lambda: gather_and_push(args, model))]
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"pushes": pushes, "shard_bytes": shard}))
    dist.barrier()
    dist.destroy_process_group()


def gather_and_push(args: argparse.Namespace, model: Any) -> Any:
    """A bridge's way: every rank gathers each tensor whole, rank 0 pushes (None elsewhere)."""
    from weightsync import WeightSender
    from weightsync.source import StateDictSource

    tensors = gathered(model)
    if dist.get_rank() != 0:
        for _ in tensors:
            pass
        return None
    with WeightSender(args.to, timeout=60, bucket_bytes=args.bucket_bytes, verify="bucket") as sender:
        return sender.push(StateDictSource(list(tensors)), args.version)


def gathered(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of a tensor-parallel `model` (one stage, no expert parallelism),
    each all-gathered whole on every rank and converted as a bridge converts it."""
    from tests.megatron_cpu import whole_tensors

    config, world = model.config, dist.get_world_size()
    for name, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False) and world > 1:
            shards = [torch.empty_like(param) for _ in range(world)]
            dist.all_gather(shards, param.detach().contiguous())
        else:
            shards = [param.detach()]
        yield from whole_tensors(model, name, shards, config)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
