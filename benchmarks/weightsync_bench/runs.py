"""The runs: memcpy, then weightsync over every configured transport and receiver count, then the
baselines, each timed end to end and checked byte for byte."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch

from weightsync.errors import ResourceError
from weightsync.sender import WeightSender
from weightsync_bench.config import BASELINES, DTYPE, GIB, BenchConfig
from weightsync_bench.measure import PeakRss, h2d_gbps, loader_copy_gbps, memcpy_gbps
from weightsync_bench.model import allocate, fill, model_shapes
from weightsync_bench.receivers import Worker, broadcast
from weightsync_bench.results import BenchReport, MethodResult

__all__ = ["MEMORY_SHARE", "fitting_size_bytes", "run"]


@dataclasses.dataclass(slots=True)
class _Run:
    config: BenchConfig
    source: dict[str, torch.Tensor]
    workers: list[Worker]
    total_bytes: int
    step: Callable[[str], None]
    host: dict[str, torch.Tensor] | None = None
    """device cuda: the host tensors the content is written in, then copied to `source`."""
    version: int = 0

    def next_version(self) -> int:
        """Fill the source with the next version's content (outside any timed region)."""
        self.version += 1
        fill(self.host if self.host is not None else self.source, self.config.seed, self.version)
        if self.host is not None:
            for name, tensor in self.host.items():
                self.source[name].copy_(tensor)
            torch.cuda.synchronize()
        return self.version


def _run_weightsync(run: _Run, transport: str, num_receivers: int, sink: str) -> MethodResult:
    config, workers = run.config, run.workers[:num_receivers]
    result = MethodResult("weightsync", transport, num_receivers, run.total_bytes, sink=sink)
    addresses = broadcast(workers, "listen", transport, config.bucket_bytes, sink)
    sender = WeightSender(
        addresses,
        bucket_bytes=config.bucket_bytes or "auto",
        timeout=config.timeout,
        num_slots=config.num_slots,
        verify=config.verify,
        raise_on_failure=False,  # a failed sync is a result (`verified_syncs`), not the end of the run
    )
    peak = PeakRss()
    try:
        for _ in range(config.repeat):
            run.step(f"weightsync {transport} x{num_receivers} ({sink})")
            version = run.next_version()
            broadcast(workers, "arm")
            peak.start()
            report = sender.push(run.source, version)
            result.sender_rss_growth.append(peak.stop())
            checks = broadcast(workers, "check", version)
            result.seconds_per_sync.append(report.seconds)
            result.bucket_bytes = report.bucket_bytes
            result.receiver_rss_growth.append(max(growth for _, growth in checks))
            result.verified_syncs.append(report.ok and all(ok for ok, _ in checks))
    finally:
        sender.close()
        broadcast(workers, "close_receiver")
    return result


def _send_baseline(method: str, source: dict[str, torch.Tensor], path: str, queue: Any, timeout: float) -> None:
    """A baseline's sending half, as a user would write it."""
    if method == "torch_save":
        torch.save(source, path)
    elif method == "safetensors":
        from safetensors.torch import save_file

        save_file(source, path)
    elif method == "mp_queue_pickle":
        for name, tensor in source.items():  # the tensor's bytes, by value; the queue holds 2 at most
            queue.put((name, pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)), timeout=timeout)
    else:
        queue.put(source, timeout=timeout)  # torch's reducers move each storage into shared memory once, then pass fds


def _run_baseline(run: _Run, method: str) -> MethodResult:
    worker = run.workers[0]
    result = MethodResult(method, None, 1, run.total_bytes)
    path = os.path.join("/dev/shm", f"weightsync-bench-{os.getpid()}-{method}")
    peak = PeakRss()
    streams = method.startswith("mp_queue")
    try:
        for _ in range(run.config.repeat):
            run.step(method)
            version = run.next_version()
            worker.call("arm")
            peak.start()
            started = time.perf_counter()
            if streams:  # the receiver waits on the queue while the sender puts
                worker.send("load", method, path)
            _send_baseline(method, run.source, path, worker.queue, run.config.timeout)
            result.sender_rss_growth.append(peak.stop())
            if not streams:  # a file is complete only once written
                worker.send("load", method, path)
            finished = worker.reply()
            result.seconds_per_sync.append(finished - started)
            ok, growth = worker.call("check", version)
            result.receiver_rss_growth.append(growth)
            result.verified_syncs.append(ok)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return result


MEMORY_SHARE = 0.8
"""The share of the memory available now that a run may plan to use: the rest is left for the
rings, page tables and whatever else runs on the machine."""

SIZE_STEP_BYTES = GIB // 4
"""`fitting_size_bytes` steps down by this much."""


def copies_in_memory(config: BenchConfig) -> int:
    """Model-sized copies a run holds at once: the source, every receiver's destinations and, for
    the baselines, a file plus a loaded copy."""
    return 1 + max(config.receivers) + (2 if config.baselines else 0)


def model_bytes(size_bytes: int) -> int:
    """The bytes of the synthetic model built for a target size (within a layer of it)."""
    return sum(math.prod(shape) for _, shape in model_shapes(size_bytes)) * DTYPE.itemsize


def fitting_size_bytes(config: BenchConfig, available: int | None = None) -> int:
    """The largest target size, at most `config.size_bytes` and a multiple of 1/4 GiB, whose run
    fits in the memory available now; 0 if not even 1/4 GiB fits."""
    budget = MEMORY_SHARE * (psutil.virtual_memory().available if available is None else available)
    size = config.size_bytes
    while copies_in_memory(config) * model_bytes(size) > budget:
        if size <= SIZE_STEP_BYTES:
            return 0
        size = (size - 1) // SIZE_STEP_BYTES * SIZE_STEP_BYTES
    return size


def _check_memory(config: BenchConfig, total_bytes: int) -> None:
    """Refuse a run that cannot fit rather than let the machine swap or kill it; say what fits."""
    copies = copies_in_memory(config)
    available = psutil.virtual_memory().available
    if copies * total_bytes <= MEMORY_SHARE * available:
        return
    fits = fitting_size_bytes(config, available)
    advice = f"--size-gb {fits / GIB:g} fits" if fits else "no size fits"
    raise ResourceError(
        f"this run holds {copies} copies of a {total_bytes / GIB:.2f} GiB model ({copies * total_bytes / GIB:.1f} GiB), "
        f"more than the {MEMORY_SHARE * available / GIB:.1f} GiB it may use here ({MEMORY_SHARE:.0%} of the "
        f"{available / GIB:.1f} GiB available now); {advice}, or run with --no-baselines or fewer --receivers"
    )


def run(config: BenchConfig) -> BenchReport:
    """Measure memcpy, then every configured transport and receiver count, then the baselines.

    Can be called in-process with tiny sizes (e.g. `BenchConfig(size_bytes=8 << 20, repeat=1,
    memcpy_bytes=8 << 20)`); receivers are always separate spawned processes.
    """
    from tqdm import tqdm

    shapes = model_shapes(config.size_bytes)
    total_bytes = model_bytes(config.size_bytes)
    _check_memory(config, total_bytes)
    num_weightsync = len(config.transports) * len(config.receivers) * len(config.sinks)
    num_steps = config.repeat * (num_weightsync + config.baselines * len(BASELINES))
    bar = tqdm(total=num_steps + 2, file=sys.stderr, disable=not config.progress, unit="step", leave=False)

    def step(what: str) -> None:
        bar.set_description(what)
        bar.update(1)

    context = multiprocessing.get_context("spawn")
    workers: list[Worker] = []
    try:
        step("memcpy")
        reference = memcpy_gbps(config.memcpy_bytes)
        loader = loader_copy_gbps(config.memcpy_bytes) if "callable" in config.sinks else None
        step("starting receivers")
        workers = [
            Worker(context, shapes, config.seed, config.timeout, config.device) for _ in range(max(config.receivers))
        ]
        host = allocate(shapes)
        source = host if config.device == "cpu" else {name: t.to(config.device) for name, t in host.items()}
        h2d = h2d_gbps(config.memcpy_bytes) if config.device == "cuda" else None
        for worker in workers:
            worker.reply(timeout=max(300.0, config.timeout))
        state = _Run(config, source, workers, total_bytes, step, host if config.device != "cpu" else None)
        results = [
            _run_weightsync(state, transport, count, sink)
            for transport in config.transports
            for count in config.receivers
            for sink in config.sinks
        ]
        if config.baselines:
            results += [_run_baseline(state, method) for method in BASELINES]
    finally:
        for worker in workers:
            worker.stop()
        bar.close()
    largest = max(math.prod(shape) for _, shape in shapes) * DTYPE.itemsize
    return BenchReport(reference, total_bytes, len(shapes), largest, results, config.device, h2d, loader)
