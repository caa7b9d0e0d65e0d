"""Push into a live transformers engine against that engine's own in-memory reload, in the same run.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_reload.py --size-gb 1

For vLLM, use `benchmarks/bench_vllm.py`: stock vLLM's server with the `weightsync` backend, a
push through vLLM's own trainer API against vLLM's own reload from disk, at TP=1 and TP=2.

Builds a Qwen2-shaped bf16 model of about `--size-gb` (`weightsync_bench.saved_model`), starts
the transformers engine in this process on dummy weights, and measures, alternating, `--repeat`
times each:
- floor: the engine takes the checkpoint's tensors from this process's memory, with no transfer
  (a `copy_` of each tensor into its parameter);
- push: a `WeightSender` in a child process pushes the same tensors over `--transport` to a
  `WeightReceiver` on the engine's own sink (what `weightsync serve` runs), with the receiver's
  breakdown: transfer, landing, load and pause.
Prints a table and, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from weightsync import WeightReceiver, WeightSender
from weightsync.checkpoint import SafetensorsSource
from weightsync_bench.saved_model import build_model


def _push(address: str, model: str, go: Any, results: Any) -> None:
    """The trainer: its tensors in memory, pushed once per version it is told to push."""
    tensors = {name: tensor.clone() for name, tensor in SafetensorsSource(model).tensors()}  # not mapped
    with WeightSender([address], timeout=300.0, raise_on_failure=False) as sender:  # the parent reads report.ok
        while (version := go.get(timeout=600)) is not None:
            report = sender.push(tensors, version)
            times = report.outcomes[0].times
            phases = {} if times is None else {field: getattr(times, field) for field in times.__struct_fields__}
            results.put((report.ok, report.seconds, phases))


def floor_reload(engine: Any, tensors: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    sink = engine.weight_sink()
    for name, tensor in tensors.items():
        sink.destination(name).copy_(tensor)
    return time.perf_counter() - started


def build_engine(model: Path) -> Any:
    from weightsync.serving.hf.engine import HFEngine

    return HFEngine(model, load_format="dummy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("hf",), default="hf", help="hf only; for vLLM: bench_vllm.py")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        weight_bytes = build_model(model, args.size_gb)
        engine = build_engine(model)
        tensors = {name: tensor.clone() for name, tensor in load_file(model / "model.safetensors").items()}
        context = multiprocessing.get_context("spawn")
        go, results = context.Queue(), context.Queue()
        floors, pushes, breakdowns = [], [], []
        with WeightReceiver(engine.weight_sink(), args.transport, timeout=300.0) as receiver:
            child = context.Process(target=_push, args=(receiver.address, str(model), go, results))
            child.start()
            floors.append(floor_reload(engine, tensors))  # warm both paths once
            for version in range(args.repeat + 1):
                go.put(version)  # push and floor alternate, never at the same time
                ok, seconds, phases = results.get(timeout=600)
                if not ok:
                    raise SystemExit("a push failed")
                pushes.append(seconds)
                breakdowns.append(phases)
                floors.append(floor_reload(engine, tensors))
            go.put(None)
            child.join(60)
        pushes, breakdowns = pushes[1:], breakdowns[1:]  # the first push connects and maps the ring
        engine.close()
    floor = statistics.median(floors[1:])
    push = statistics.median(pushes)
    phases = {key: statistics.median(b[key] for b in breakdowns) for key in breakdowns[0]}
    result = {
        "engine": args.engine,
        "transport": args.transport,
        "weight_bytes": weight_bytes,
        "floor_s": [round(s, 4) for s in floors],
        "push_s": [round(s, 4) for s in pushes],
        "push_over_floor": round(push / floor, 3),
        "receiver_phases_median_s": {key: round(value, 4) for key, value in phases.items()},
    }
    print(
        f"{args.engine}, {weight_bytes / (1 << 30):.2f} GiB bf16, {args.transport}: "
        f"floor (engine's own reload from memory) {floor:.3f} s, push {push:.3f} s = {push / floor:.2f}x; "
        f"receiver: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()),
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
