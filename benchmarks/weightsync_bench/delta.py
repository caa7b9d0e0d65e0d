"""`weightsync-bench --delta-lr LR`: delta sync against full sync, same model, same run.

The sender holds fp32 master weights N(0, 0.02) and, every step, moves them by `lr` times a fixed
unit-variance direction, held in bf16 (an Adam step whose momentum dominates: every element moves
by about `lr`), then pushes them cast to bf16 twice: with `delta=True` to one receiving process and with a
plain full push to another. Both receivers are separate processes holding bf16 destinations.
Each delta push is verified by its receiver (the content digest of the full new weights); the
report gives, per transport and step, the changed fraction, the wire bytes and the time of each.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.receiver import WeightReceiver
from weightsync.report import SyncReport
from weightsync.sender import WeightSender
from weightsync_bench.measure import memcpy_gbps

__all__ = ["DeltaStep", "format_delta_table", "run_delta"]

TENSOR_ELEMENTS = 1 << 24
"""Elements per tensor of the synthetic model (32 MiB in bf16)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeltaStep:
    """One step of one transport: the delta push and the full push of the same weights."""

    transport: str
    step: int
    changed_fraction: float
    delta_wire_bytes: int
    full_wire_bytes: int
    delta_s: float
    full_s: float
    delta_mode: str
    """What the delta sender did: "delta" (a patch), "full" (the full version, verified: a
    refresh, a base for the next patch) or "plain" (as without delta)."""
    memcpy_s: float
    """The same bytes through a single-thread memcpy, measured in this transport's run (so each
    step's times can be read against the host's speed at that time)."""


def _shapes(size_bytes: int) -> list[tuple[int, ...]]:
    elements = max(1, size_bytes // 2)
    sizes = [TENSOR_ELEMENTS] * (elements // TENSOR_ELEMENTS)
    if elements % TENSOR_ELEMENTS:
        sizes.append(elements % TENSOR_ELEMENTS)
    return [(size,) for size in sizes]


def _receive(transport: str, shapes: Sequence[tuple[int, ...]], addresses: Any, stop: Any) -> None:
    dest = {f"w{i}": torch.zeros(shape, dtype=torch.bfloat16) for i, shape in enumerate(shapes)}
    with WeightReceiver(dest, transport, timeout=600.0) as receiver:
        addresses.put(receiver.address)
        stop.wait()


def run_delta(
    transports: Sequence[str],
    size_bytes: int,
    lr: float,
    steps: int,
    seed: int = 0,
    bucket_bytes: int | str = "auto",
    memcpy_bytes: int = 1 << 30,
) -> list[DeltaStep]:
    """Push `steps` steps of the synthetic model per transport, delta (over every transport,
    `delta="all"`: what a diff costs there) and full; what each took."""
    shapes = _shapes(size_bytes)
    model_bytes = sum(math.prod(shape) for shape in shapes) * 2  # bf16 on the wire
    gen = torch.Generator().manual_seed(seed)
    results = []
    context = multiprocessing.get_context("spawn")
    for transport in transports:
        master = {f"w{i}": torch.randn(shape, generator=gen) * 0.02 for i, shape in enumerate(shapes)}
        # bf16 is enough for a direction: an element moves by lr times it, and it halves the memory
        direction = {name: torch.randn(t.shape, generator=gen).to(torch.bfloat16) for name, t in master.items()}
        addresses, stop = context.Queue(), context.Event()
        procs = [context.Process(target=_receive, args=(transport, shapes, addresses, stop)) for _ in range(2)]
        for proc in procs:
            proc.start()
        try:
            delta_address, full_address = addresses.get(timeout=600), addresses.get(timeout=600)
            options: dict[str, Any] = {"cast": torch.bfloat16, "timeout": 600.0, "bucket_bytes": bucket_bytes}
            with (
                WeightSender(delta_address, delta="all", **options) as delta,
                WeightSender(full_address, **options) as full,
            ):
                for step in range(steps + 1):
                    if step:
                        for name, weight in master.items():
                            weight.add_(direction[name], alpha=-lr)
                    # the two pushes take turns going first: whichever follows the optimizer
                    # step reads weights it just wrote, and the other sees a different cache
                    (delta_report, delta_s), (full_report, full_s) = _pushed_in_turn(delta, full, master, step)
                    memcpy_s = model_bytes / (memcpy_gbps(min(memcpy_bytes, model_bytes), rounds=1) * 1e9)
                    (outcome,) = delta_report.outcomes
                    results.append(
                        DeltaStep(
                            transport,
                            step,
                            delta_report.changed_fraction,
                            outcome.wire_bytes,
                            full_report.wire_bytes,
                            delta_s,
                            full_s,
                            outcome.mode if outcome.mode == "delta" or delta_report.content_digest else "plain",
                            memcpy_s,
                        )
                    )
        finally:
            stop.set()
            for proc in procs:
                proc.join(60)
    return results


def _pushed_in_turn(
    delta: WeightSender, full: WeightSender, master: dict[str, torch.Tensor], step: int
) -> tuple[tuple[SyncReport, float], tuple[SyncReport, float]]:
    """Push `master` as version `step` through both senders, delta first on even steps; each
    report with the seconds its push took."""
    timed = {}
    for sender in (delta, full) if step % 2 == 0 else (full, delta):
        started = time.perf_counter()
        report = sender.push(master, step, deadline=None)
        timed[sender] = (report, time.perf_counter() - started)
    return timed[delta], timed[full]


def format_delta_table(results: Sequence[DeltaStep]) -> str:
    """One row per transport and step, then each transport's median delta/full time ratio."""
    lines = [
        "transport  step  mode   changed   delta MB   full MB   delta s   full s  memcpy s  delta/full  full/memcpy",
    ]
    for r in results:
        lines.append(
            f"{r.transport:<9} {r.step:>5}  {r.delta_mode:<5} {r.changed_fraction:>8.4f} "
            f"{r.delta_wire_bytes / 1e6:>10.2f} {r.full_wire_bytes / 1e6:>9.2f} {r.delta_s:>9.3f} "
            f"{r.full_s:>8.3f} {r.memcpy_s:>9.3f} {r.delta_s / r.full_s:>11.2f} {r.full_s / r.memcpy_s:>12.2f}"
        )
    for transport in dict.fromkeys(r.transport for r in results):
        ratios = sorted(r.delta_s / r.full_s for r in results if r.transport == transport and r.delta_mode == "delta")
        if ratios:
            lines.append(f"{transport}: median delta/full time over delta steps = {ratios[len(ratios) // 2]:.2f}")
        every = sorted(r.delta_s / r.full_s for r in results if r.transport == transport and r.step > 0)
        if every:
            lines.append(
                f"{transport}: median delta/full time over steps 1-{len(every)}, whatever the sender chose = "
                f"{every[len(every) // 2]:.2f}"
            )
    return "\n".join(lines)
