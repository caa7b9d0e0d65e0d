"""Colocated sync on one GPU: a trainer process pushes a Qwen3-4B-shaped bf16 state dict (398
tensors, 8.04 GB, built from the shape table below, nothing downloaded) over cudaipc to 1 and to
4 receiving processes on the same GPU, beside the device copy it is measured against.

    python benchmarks/gpu/bench_colocated.py --json OUT.json

Timed per sync: `WeightSender.push` from its call until every receiver committed (each receiver
synchronises its device before committing). Between syncs the trainer changes every tensor in
place (an optimizer step), so each sync moves new bytes; after the last one every receiver's
tensors are checked against the trainer's (a per-tensor sum of the bf16 bits, on the GPU).

Methods:
- `device copy`: `dst.copy_(src)` for each tensor in one process, then a synchronise: the ceiling.
- `direct`: the trainer's dict (held tensors): receivers copy straight from its memory (cudaipc's
  direct path).
- `ring`: the same tensors from a source that does not hold them (as a generator would): the
  GPU ring, 512 MiB buckets.

The first sync (sharing and opening the handles) is reported apart from the steady state (the
median of the others). GB/s counts the model's bytes once per receiver.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

QWEN3_4B = {"hidden": 2560, "intermediate": 9728, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128}
QWEN3_4B_VOCAB = 151936
"""Qwen3-4B's config; its lm_head is tied to the embedding, so the state dict has 398 tensors."""

MIB = 1 << 20


def qwen3_shapes(config: dict[str, int] = QWEN3_4B, vocab: int = QWEN3_4B_VOCAB) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3 decoder's state dict (tied embedding), in checkpoint order."""
    hidden, head_dim = config["hidden"], config["head_dim"]
    q, kv = config["heads"] * head_dim, config["kv_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(config["layers"]):
        prefix = f"model.layers.{layer}."
        shapes += [
            (prefix + "self_attn.q_proj.weight", (q, hidden)),
            (prefix + "self_attn.k_proj.weight", (kv, hidden)),
            (prefix + "self_attn.v_proj.weight", (kv, hidden)),
            (prefix + "self_attn.o_proj.weight", (hidden, q)),
            (prefix + "self_attn.q_norm.weight", (head_dim,)),
            (prefix + "self_attn.k_norm.weight", (head_dim,)),
            (prefix + "mlp.gate_proj.weight", (config["intermediate"], hidden)),
            (prefix + "mlp.up_proj.weight", (config["intermediate"], hidden)),
            (prefix + "mlp.down_proj.weight", (hidden, config["intermediate"])),
            (prefix + "input_layernorm.weight", (hidden,)),
            (prefix + "post_attention_layernorm.weight", (hidden,)),
        ]
    return [*shapes, ("model.norm.weight", (hidden,))]


def bit_sums(tensors: list[torch.Tensor]) -> list[int]:
    """A per-tensor sum of the bf16 bits as int16: changes when any tensor is stale."""
    return [int(s) for s in torch.stack([t.view(torch.int16).sum(dtype=torch.int64) for t in tensors]).tolist()]


def receiver_main(conn: Any, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    """One receiving process: zeroed destinations on the GPU, a cudaipc receiver over them."""
    from weightsync import WeightReceiver

    dest = {name: torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for name, shape in shapes}
    receiver = WeightReceiver(dest, transport="cudaipc", max_bucket_bytes=1 << 30, timeout=120.0).start()
    conn.send(receiver.address)
    while (command := conn.recv()) != "close":
        if command == "sums":
            torch.cuda.synchronize()
            conn.send((receiver.version, bit_sums(list(dest.values()))))
    receiver.close()
    conn.send("closed")


class Receivers:
    """`count` receiving processes, started together."""

    def __init__(self, count: int, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        context = mp.get_context("spawn")
        pipes = [context.Pipe() for _ in range(count)]
        self.procs = [context.Process(target=receiver_main, args=(child, shapes)) for _, child in pipes]
        for proc in self.procs:
            proc.start()
        self.conns = [parent for parent, _ in pipes]
        self.addresses = [conn.recv() for conn in self.conns]

    def sums(self) -> list[tuple[int, list[int]]]:
        for conn in self.conns:
            conn.send("sums")
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send("close")
        for conn, proc in zip(self.conns, self.procs, strict=True):
            conn.recv()
            proc.join(60)


class NotHeld:
    """The same tensors from a source that does not say it holds them: the GPU ring carries them."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self._named = named

    def metas(self) -> list[Any]:
        from weightsync import TensorMeta

        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self._named.items()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._named.items())


def device_copy_s(source: list[torch.Tensor], repeat: int) -> list[float]:
    """Seconds of `dst.copy_(src)` over every tensor, then a synchronise, `repeat` times."""
    dest = [torch.empty_like(t) for t in source]
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for d, s in zip(dest, source, strict=True):
            d.copy_(s)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del dest
    torch.cuda.empty_cache()
    return times[1:]  # the first pays for nothing but is kept out, like a warm-up


def run_pushes(named: dict[str, torch.Tensor], method: str, receivers: int, syncs: int, bucket: str) -> dict[str, Any]:
    from weightsync import WeightSender

    shapes = [(name, tuple(t.shape)) for name, t in named.items()]
    group = Receivers(receivers, shapes)
    source: Any = named if method == "direct" else NotHeld(named)
    times, reports = [], []
    try:
        with WeightSender(group.addresses, bucket_bytes=bucket, timeout=120.0) as sender:
            for version in range(1, syncs + 1):
                for tensor in named.values():
                    tensor.add_(1)  # an optimizer step, in place
                torch.cuda.synchronize()
                started = time.perf_counter()
                report = sender.push(source, version=version)
                times.append(time.perf_counter() - started)
                reports.append(report)
        expected = bit_sums(list(named.values()))
        checked = group.sums()
    finally:
        group.close()
    exact = all(version == syncs and sums == expected for version, sums in checked)
    last = reports[-1]
    return {
        "method": method,
        "receivers": receivers,
        "bucket_bytes": last.bucket_bytes,
        "num_buckets": last.num_buckets,
        "first_s": times[0],
        "steady_s": statistics.median(times[1:]),
        "times_s": times,
        "bit_exact": exact,
        "receiver_times": [dataclass_dict(o.times) for o in last.outcomes],
    }


def dataclass_dict(value: Any) -> dict[str, float]:
    return {field: getattr(value, field) for field in value.__struct_fields__} if value is not None else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receivers", default="1,4", help="receiver counts, comma list")
    parser.add_argument("--syncs", type=int, default=6, help="syncs per configuration (the first reported apart)")
    parser.add_argument("--ring", action=argparse.BooleanOptionalAction, default=True, help="also the ring path")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_colocated: no CUDA device here; nothing measured", file=sys.stderr)
        return 0
    shapes = qwen3_shapes()
    generator = torch.Generator(device="cuda").manual_seed(0)
    named = {
        name: torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        for name, shape in shapes
    }
    total = sum(t.numel() * t.element_size() for t in named.values())
    copy_times = device_copy_s(list(named.values()), repeat=max(args.syncs, 5))
    copy_gbps = total / statistics.median(copy_times) / 1e9
    runs = [run_pushes(named, "direct", int(n), args.syncs, "auto") for n in args.receivers.split(",")]
    if args.ring:
        runs.append(run_pushes(named, "ring", 1, args.syncs, str(512 * MIB)))
    for run in runs:
        run["steady_gbps"] = total * run["receivers"] / run["steady_s"] / 1e9
        run["first_gbps"] = total * run["receivers"] / run["first_s"] / 1e9
        run["x_device_copy"] = run["steady_gbps"] / copy_gbps
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": {"name": "Qwen3-4B-shaped, bf16, tied embedding", "tensors": len(named), "bytes": total},
        "device_copy": {"gbps": copy_gbps, "times_s": copy_times},
        "runs": runs,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    print(f"{result['device']}, torch {result['torch']}; {len(named)} tensors, {total / 1e9:.2f} GB bf16")
    print(f"device copy (copy_ per tensor, one process): {copy_gbps:.0f} GB/s")
    header = "method  receivers  bucket MiB  buckets  first GB/s  steady GB/s  x device copy  s/sync (steady)  exact"
    print(header)
    for run in runs:
        print(
            f"{run['method']:<6}  {run['receivers']:>9}  {run['bucket_bytes'] / MIB:>10.0f}  {run['num_buckets']:>7}  "
            f"{run['first_gbps']:>10.0f}  {run['steady_gbps']:>11.0f}  {run['x_device_copy']:>13.2f}  "
            f"{run['steady_s']:>15.4f}  {run['bit_exact']}"
        )
    return 0 if all(run["bit_exact"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
