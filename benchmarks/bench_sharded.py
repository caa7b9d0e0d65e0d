"""Sharded sync against today's full push: a 2-rank FSDP2 trainer into stock vLLM at TP=2, the
same weights, in one run.

    .venv/bin/python benchmarks/bench_sharded.py --json sharded.json         # 0.8 GiB, 3 pushes each
    .venv/bin/python benchmarks/bench_sharded.py --size-gb 0.2 --repeat 1    # smoke test

It builds a Qwen2-shaped float32 model of about `--size-gb` GiB whose embedding and lm_head
(`--vocab` x 1536) are each larger than a bucket (`--bucket-mb`), starts stock vLLM's OpenAI
server at TP=2 (dummy weights, the weightsync backend: `bench_vllm.VLLMServer`), and runs the
trainer twice, alternating `--rounds` times: `torchrun --nproc-per-node 2 -m
weightsync_bench.fsdp_ranks` (gloo, `init_device_mesh("cpu", (2,))`, `fully_shard`), each rank
calling vLLM's trainer API, with

- `full`: today's push: every rank gathers each tensor whole (`full_tensor()`), rank 0 sends
  whole tensors to both workers, rank 1 walks the source in step;
- `sharded`: `WeightsyncTrainerInitInfo(sharded=True)`: each rank sends its rows of each tensor
  straight to the workers that keep them, each worker only its boxes.

Each trainer run pushes once to warm up (reported as "first") and `--repeat` times more. Per
mode it reports the bytes each worker received (summed over the ranks' reports), each rank's
peak RSS growth during a push (`PeakRss`: the kernel's VmHWM reset before each push, or RSS
sampled every millisecond) against its own shard plus its buckets (every ring it holds:
`num_slots` x bucket per distinct plan), and the push time (rank 0's `send_weights`, end to
end). After each trainer run, vLLM's per-parameter checksums must equal those after the first
full push (the same weights, whatever the mode), and every push must have committed.

Prints a table; `--json FILE` writes every figure.
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

from bench_vllm import BenchmarkError, VLLMServer, versions
from weightsync_bench.measure import environment
from weightsync_bench.saved_model import build_model, read_through

MIB = 1 << 20
NUM_SLOTS = 2
"""The senders' ring slots (SenderOptions' default)."""


def trainer_run(
    server: VLLMServer, model: Path, mode: str, args: argparse.Namespace, first: int, out: Path
) -> list[dict[str, Any]]:
    """One torchrun of the FSDP2 trainer (`mode`): each rank's report of its pushes."""
    out.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "weightsync_bench.fsdp_ranks",
    ]
    command += ["--model", str(model), "--out", str(out), "--vllm", server.url, "--mode", mode, "--vllm-source"]
    command += ["--transport", args.transport, "--versions", str(1 + args.repeat), "--first-version", str(first)]
    command += ["--bucket-bytes", str(args.bucket_mb * MIB)]
    done = subprocess.run(
        command, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode:
        raise BenchmarkError(f"the {mode} trainer failed:\n{done.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    if not all(push["ok"] for rank in ranks for push in rank["pushes"]):
        raise BenchmarkError(f"a {mode} push did not commit: {ranks}")
    return ranks


def mode_row(runs: list[list[dict[str, Any]]], bucket_bytes: int, mode: str) -> dict[str, Any]:
    """What the runs of one mode measured: per worker bytes, per rank memory, push seconds."""
    steady = [push for ranks in runs for push in ranks[0]["pushes"][1:]]
    workers = sorted(runs[0][0]["pushes"][0]["wire_bytes"])
    received = [sum(rank["pushes"][0]["wire_bytes"].get(w, 0) for rank in runs[0]) for w in workers]
    rings = NUM_SLOTS * bucket_bytes * (len(workers) if mode == "sharded" else 1)
    ranks = []
    for rank in range(2):
        peaks = [push["peak_rss_added"] for ranks_ in runs for push in ranks_[rank]["pushes"]]
        shard = runs[0][rank]["shard_bytes"]
        ring = rings if mode == "sharded" or rank == 0 else 0
        ranks.append(
            {
                "shard_bytes": shard,
                "rings_bytes": ring,
                "peak_rss_added_max": max(peaks),
                "peak_rss_added_first": runs[0][rank]["pushes"][0]["peak_rss_added"],
                "peak_rss_added_steady_median": statistics.median(peaks[1:] or peaks),
                "within_shard_plus_buckets": max(peaks) <= shard + ring,
            }
        )
    return {
        "received_bytes_per_worker": received,
        "ranks": ranks,
        "push_first_s": runs[0][0]["pushes"][0]["seconds"],
        "push_median_s": statistics.median(push["seconds"] for push in steady),
        "push_seconds": [push["seconds"] for push in steady],
    }


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    model = scratch / "model"
    weight_bytes = build_model(model, args.size_gb, dtype="float32", vocab_size=args.vocab)
    read_through(model)
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "model": {
            "shape": "Qwen2",
            "dtype": "float32",
            "weight_bytes": weight_bytes,
            "vocab": args.vocab,
            "embedding_bytes": args.vocab * 1536 * 4,
            "bucket_bytes": args.bucket_mb * MIB,
        },
        "environment": environment() | versions() | {"loadavg_start": os.getloadavg()},
        "transport": args.transport,
        "repeat": args.repeat,
    }
    server = VLLMServer(model, 2, scratch, args.timeout)
    try:
        runs: dict[str, list[Any]] = {"full": [], "sharded": []}
        reference = None
        version = 1
        for round_ in range(args.rounds):
            for mode in ("full", "sharded"):
                ranks = trainer_run(server, model, mode, args, version, scratch / f"{mode}{round_}")
                version += 1 + args.repeat
                checksums = server.post("/weight_checker", {"action": "checksum"})["checksums"]
                reference = reference or checksums
                if checksums != reference:
                    raise BenchmarkError(
                        f"after the {mode} push, the workers serve other weights than after a full push"
                    )
                runs[mode].append(ranks)
        bucket = args.bucket_mb * MIB
        result["modes"] = {mode: mode_row(found, bucket, mode) for mode, found in runs.items()}
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.close()
    full, sharded = result["modes"]["full"], result["modes"]["sharded"]
    whole = max(full["received_bytes_per_worker"])  # a full push sends every worker the same
    result["received_sharded_over_full"] = [received / whole for received in sharded["received_bytes_per_worker"]]
    result["push_sharded_over_full"] = sharded["push_median_s"] / full["push_median_s"]
    result["environment"]["loadavg_end"] = os.getloadavg()
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"{'mode':8} {'worker MiB':>22} {'rank peak MiB (shard+rings)':>34} {'push s':>8}"]
    for mode, row in result["modes"].items():
        workers = " ".join(f"{b / MIB:8.1f}" for b in row["received_bytes_per_worker"])
        ranks = " ".join(
            f"{r['peak_rss_added_max'] / MIB:6.1f} ({(r['shard_bytes'] + r['rings_bytes']) / MIB:6.1f})"
            for r in row["ranks"]
        )
        lines.append(f"{mode:8} {workers:>22} {ranks:>34} {row['push_median_s']:8.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.8)
    parser.add_argument("--vocab", type=int, default=32768, help="embedding rows (x 1536 x 4 bytes)")
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--transport", default="shm", choices=["shm", "tcp", "collective"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="full then sharded, this many times")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as scratch:
        result = run(args, Path(scratch))
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
