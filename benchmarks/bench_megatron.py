"""A Megatron-Core trainer's push, sharded against gather-then-push-whole: 2 ranks at TP=2, the
same weights, in one run.

    .venv/bin/python benchmarks/bench_megatron.py --size-gb 0.2 --json megatron.json

It saves a Qwen2-shaped float32 checkpoint of about `--size-gb` GiB (`saved_model.build_model`),
starts two receivers that keep what two tensor-parallel workers keep (rows of q, k, v, gate, up
and the vocabulary, columns of o and down; norms whole), and runs the trainer (`torchrun
--nproc-per-node 2 -m weightsync_bench.megatron_ranks`, gloo, real megatron-core on CPU) in turn,
`--rounds` times:

- `sharded`: every rank pushes its boxes (`MegatronSource`), each worker only the boxes it keeps;
- `gather`: what a bridge's export does: every rank all-gathers each parameter and converts it,
  rank 0 collects the checkpoint and pushes it whole to both workers.

Per mode: the bytes each worker received (summed over the ranks), each rank's peak RSS growth
during its push (`PeakRss`) against its own shard, and the push time (the slowest rank's). Every
push must commit and land the checkpoint's content digest. Prints a table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 1 << 20


def worker_wants(checkpoint: dict[str, Any], worker: int) -> tuple[Any, ...]:
    """The boxes TP worker `worker` of 2 keeps: its half of the rows (q, k, v, gate, up, the
    vocabulary) or of the columns (o, down) of each tensor, every 1-D tensor whole."""
    from weightsync.messages import Want

    wants = []
    for name, tensor in checkpoint.items():
        shape = tuple(tensor.shape)
        if tensor.dim() < 2:
            wants.append(Want(name, (0,) * len(shape), shape))
            continue
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        half = shape[dim] // 2
        start = tuple(half * worker if d == dim else 0 for d in range(len(shape)))
        stop = tuple(half * (worker + 1) if d == dim else shape[d] for d in range(len(shape)))
        wants.append(Want(name, start, stop))
    return tuple(wants)


def run(model: Path, out: Path, mode: str, addresses: list[str], version: int) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m"]
    command += ["weightsync_bench.megatron_ranks", "--model", str(model), "--out", str(out), "--mode", mode]
    command += ["--tp", "2", "--version", str(version), "--to", *addresses]
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}:{root / 'benchmarks'}"}
    subprocess.run(command, check=True, timeout=1200, env=env, stdout=subprocess.DEVNULL)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from weightsync import TensorDictSink, WeightReceiver
    from weightsync.digest import source_digest
    from weightsync_bench.measure import environment
    from weightsync_bench.saved_model import build_model

    class Keeps(TensorDictSink):
        def __init__(self, tensors: dict[str, torch.Tensor], wants: tuple[Any, ...]) -> None:
            super().__init__(tensors)
            self._wants = wants

        def wants(self) -> tuple[Any, ...]:
            return self._wants

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp, "model")
        full_bytes = build_model(model, args.size_gb, dtype="float32")
        checkpoint = {}
        for path in sorted(model.glob("*.safetensors")):
            checkpoint.update(load_file(path))
        digest = source_digest(checkpoint)
        sinks = [
            Keeps({n: torch.zeros_like(t) for n, t in checkpoint.items()}, worker_wants(checkpoint, w))
            for w in range(2)
        ]
        receivers = [WeightReceiver(sink, "tcp", timeout=300) for sink in sinks]
        results: dict[str, list[dict[str, Any]]] = {"sharded": [], "gather": []}
        with receivers[0].start(), receivers[1].start():
            addresses = [receiver.address for receiver in receivers]
            version = 0
            for round_ in range(args.rounds):
                for mode in results:
                    version += 1
                    ranks = run(model, Path(tmp, f"{mode}{round_}"), mode, addresses, version)
                    pushes = [rank["pushes"][0] for rank in ranks]
                    assert all(push["ok"] for push in pushes), pushes
                    assert all(r.version == version and r.content_digest == digest for r in receivers)
                    results[mode].append(
                        {
                            "seconds": max(push["seconds"] for push in pushes),
                            "worker_bytes": [sum(p["wire_bytes"].get(a, 0) for p in pushes) for a in addresses],
                            "peak_rss_added": [push["peak_rss_added"] for push in pushes],
                            "shard_bytes": [rank["shard_bytes"] for rank in ranks],
                        }
                    )
    print(f"checkpoint {full_bytes / MIB:.1f} MiB, 2 Megatron ranks at TP=2 -> 2 workers keeping TP=2 boxes")
    print("| mode | push s (median) | each worker receives | x full | peak RSS added per rank | rank's shard |")
    print("|---|---|---|---|---|---|")
    for mode, rounds in results.items():
        last = rounds[-1]
        seconds = statistics.median(r["seconds"] for r in rounds)
        received = ", ".join(f"{b / MIB:.1f} MiB" for b in last["worker_bytes"])
        ratio = max(last["worker_bytes"]) / full_bytes
        peaks = ", ".join(f"{max(r['peak_rss_added'][k] for r in rounds) / MIB:.1f} MiB" for k in range(2))
        shards = ", ".join(f"{b / MIB:.1f} MiB" for b in last["shard_bytes"])
        print(f"| {mode} | {seconds:.3f} | {received} | {ratio:.2f} | {peaks} | {shards} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"environment": environment(), "full_bytes": full_bytes, **results}, indent=1)
        )


if __name__ == "__main__":
    main()
