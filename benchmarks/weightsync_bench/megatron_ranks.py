"""A Megatron-Core trainer whose ranks push: run by torchrun, for bench_megatron.py and the tests.

    python -m torch.distributed.run --nproc-per-node 2 -m weightsync_bench.megatron_ranks \\
        --model DIR --out DIR --tp 2 --pp 1 --ep 1 (--vllm URL | --sglang URL | --to ADDRESS ...) \\
        [--mode sharded|gather] [--versions N --delta] [--then-full-to ADDRESS ...]

Each rank builds its `GPTModel` shard on CPU (gloo, tests/megatron_cpu.py's test-only patches)
and loads its part of the checkpoint at DIR into it. Then it pushes (`--versions`, default once):

- `--mode sharded`: every rank pushes its boxes of the checkpoint tensors (`MegatronSource`),
  through a `WeightSender` of its own (`--to`: receivers, e.g. `weightsync serve`'s), vLLM's
  trainer API (`--vllm`) or `SGLangEngine(sharded=True)` (`--sglang`).
- `--mode gather` (tensor parallel only): what a bridge's export does, for comparison: every
  rank all-gathers each parameter and converts it to checkpoint tensors, rank 0 pushes them
  whole (one `WeightSender`), the other ranks gather in step.

`--delta` (with `--to` or `--vllm`): the pushes carry deltas, and before every push but the first
the trainer steps (`fsdp_ranks.train_step`: about 3% of the elements of every parameter each rank
holds move; copies of a tensor on several ranks move alike). `--then-full-to`: after them, one
push of the same weights without delta, to other receivers, as the last version: a reference
that the last delta push must equal.

Rank r writes OUT/rank{r}.json: its pushes, in order (`fsdp_ranks.measured`: ok, seconds, peak RSS growth,
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
    parser.add_argument("--sglang", default="")
    parser.add_argument("--to", nargs="*", default=[])
    parser.add_argument("--mode", choices=["sharded", "gather"], default="sharded")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=96 << 10)
    parser.add_argument("--versions", type=int, default=1)
    parser.add_argument("--delta", action="store_true", help="delta pushes, a training step before each but the first")
    parser.add_argument("--then-full-to", nargs="*", default=[], help="then the last weights in full to these")
    args = parser.parse_args()
    args.first_version = args.version

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
        pushes = sharded_push(args, source, model)
        if args.then_full_to:
            last = args.version + args.versions - 1
            reference = {"to": args.then_full_to, "first_version": last, "versions": 1, "delta": False}
            pushes += push_to(argparse.Namespace(**vars(args) | reference), source)
    else:
        pushes = [measured(lambda: gather_and_push(args, model))]
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"pushes": pushes, "shard_bytes": shard}))
    dist.barrier()
    dist.destroy_process_group()


def sharded_push(args: argparse.Namespace, source: Any, model: Any) -> list[dict[str, Any]]:
    """This rank's part pushed `--versions` times (with `--delta`, `model` steps between them) to
    the target the arguments name (SGLang: once, without delta)."""
    if args.vllm:
        return push_to_vllm(args, source, model)
    if args.sglang:
        if args.delta or args.versions != 1:
            raise SystemExit("megatron_ranks: --sglang pushes once, without --delta")
        return [measured(lambda: push_to_sglang(args, source))]
    return push_to(args, source, model)


def push_to_sglang(args: argparse.Namespace, source: Any) -> Any:
    """One sharded push into SGLang: every rank builds `SGLangEngine(sharded=True)` and pushes."""
    from weightsync import SenderOptions
    from weightsync.integrations.sglang import SGLangEngine

    options = SenderOptions(verify="bucket", timeout=120, bucket_bytes=args.bucket_bytes)
    with SGLangEngine(args.sglang, transport=args.transport, options=options, deadline=120, sharded=True) as engine:
        return engine.push(source, version=args.version)


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
