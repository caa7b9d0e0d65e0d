"""`weightsync bench`: push a synthetic model through each transport and the usual baselines.

Every method is timed the same way, end to end: from the sender's first byte until the values
sit in a separate receiving process's preallocated (and already resident) destination tensors.
Each receiver then checks every byte against content regenerated from the seed, outside the
timed region. Content differs per tensor and per sync, so stale bytes cannot pass.

The sender is this process; receivers are spawned processes that hold their destination
tensors for the whole run. Baselines (`torch.save`/`torch.load` and safetensors through a
`/dev/shm` file, a `multiprocessing` queue) always run against one receiver.

Peak RSS growth is measured per process over each sync: the kernel's peak (VmHWM) is reset
through `/proc/self/clear_refs` before it and read after it; where that is not allowed a
thread samples RSS every millisecond instead. Shared-memory pages a process maps and touches
count, as they do in RSS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import pickle
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
import torch

from weightsync.errors import BenchError, ConfigError, ResourceError
from weightsync.pack import STREAMING_COPY, byte_view
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender

__all__ = [
    "BASELINES",
    "DEFAULT_TRANSPORTS",
    "TRANSPORTS",
    "BenchConfig",
    "BenchReport",
    "MethodResult",
    "format_table",
    "run",
]

MIB = 1 << 20
GIB = 1 << 30
TRANSPORTS = ("shm", "tcp", "collective", "cudaipc")
"""Transports the benchmark can run: the cross-process ones (inproc never leaves the process);
cudaipc only with device cuda."""
DEFAULT_TRANSPORTS = ("shm", "tcp")
"""What `--transport all` runs on the CPU; with device cuda, cudaipc too."""
BASELINES = ("torch_save", "safetensors", "mp_queue_pickle", "mp_queue_shared")
"""Run in this order: `mp_queue_shared` moves the source tensors into shared memory, so it goes last."""
DTYPE = torch.bfloat16


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class BenchConfig:
    """What one benchmark run measures."""

    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    """Transports to push through ("shm", "tcp", "collective", "cudaipc")."""
    size_bytes: int = 4 * GIB
    """Target size of the synthetic state dict (the actual size is within a layer of it)."""
    bucket_bytes: int | None = None
    """Bucket size to propose; None lets the sender choose ("auto")."""
    receivers: tuple[int, ...] = (1,)
    """Receiver counts to run each transport with (e.g. (1, 4) for the fan-out comparison)."""
    repeat: int = 3
    """Syncs per configuration; the first pays for connecting and mapping, later ones reuse."""
    baselines: bool = True
    """Also run `BASELINES` (one receiver)."""
    memcpy_bytes: int = GIB
    """Buffer size for the single-thread memcpy reference."""
    num_slots: int = 2
    """Shared-memory ring slots on the sender."""
    verify: str = "off"
    """With "bucket", every bucket is checksummed (the sender hashes, each receiver checks)."""
    seed: int = 0
    timeout: float = 120.0
    """Seconds any one step (a sync, a receiver's reply) may take."""
    progress: bool = False
    """Show a progress bar on stderr."""
    device: str = "cpu"
    """Where the trainer's tensors and every receiver's destinations live: "cpu" or "cuda"."""

    def __post_init__(self) -> None:
        unknown = set(self.transports) - set(TRANSPORTS)
        if unknown:
            raise ConfigError(f"unknown transport(s) {sorted(unknown)}; the benchmark runs {list(TRANSPORTS)}")
        if self.size_bytes < MIB:
            raise ConfigError(f"size_bytes must be at least 1 MiB, got {self.size_bytes}")
        if not self.receivers or min(self.receivers) < 1:
            raise ConfigError(f"receivers must be positive counts, got {self.receivers}")
        if self.repeat < 1 or self.memcpy_bytes < MIB or self.timeout <= 0:
            raise ConfigError("repeat must be >= 1, memcpy_bytes >= 1 MiB and timeout > 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda: torch sees no CUDA device here")
        if "cudaipc" in self.transports and self.device != "cuda":
            raise ConfigError("the cudaipc transport moves GPU tensors: run it with device cuda")
        if self.device == "cuda" and self.baselines:
            raise ConfigError("the baselines run on cpu only: with device cuda, turn them off (--no-baselines)")
        if self.bucket_bytes is not None and self.bucket_bytes < 64:
            raise ConfigError(f"bucket_bytes must be >= 64, got {self.bucket_bytes}")


@dataclasses.dataclass(slots=True)
class MethodResult:
    """One method (weightsync over a transport, or a baseline) at one receiver count."""

    method: str
    transport: str | None
    receivers: int
    total_bytes: int
    bucket_bytes: int | None = None
    seconds_per_sync: list[float] = dataclasses.field(default_factory=list)
    sender_rss_growth: list[int] = dataclasses.field(default_factory=list)
    receiver_rss_growth: list[int] = dataclasses.field(default_factory=list)
    """The largest growth among the receivers, per sync."""
    verified_syncs: list[bool] = dataclasses.field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Median over the syncs, in 1e9 bytes per second."""
        return self.total_bytes / statistics.median(self.seconds_per_sync) / 1e9

    @property
    def first_sync_gbps(self) -> float:
        return self.total_bytes / self.seconds_per_sync[0] / 1e9

    @property
    def best_gbps(self) -> float:
        return self.total_bytes / min(self.seconds_per_sync) / 1e9

    @property
    def verified(self) -> bool:
        return bool(self.verified_syncs) and all(self.verified_syncs)

    def to_json(self, memcpy_gbps: float) -> dict[str, Any]:
        return {
            "method": self.method,
            "transport": self.transport,
            "receivers": self.receivers,
            "gbps": round(self.gbps, 3),
            "ratio_to_memcpy": round(self.gbps / memcpy_gbps, 3),
            "bucket_bytes": self.bucket_bytes,
            "sender_peak_rss_growth_bytes": max(self.sender_rss_growth),
            "receiver_peak_rss_growth_bytes": max(self.receiver_rss_growth),
            "verified": self.verified,
            "total_bytes": self.total_bytes,
            "seconds_per_sync": [round(s, 4) for s in self.seconds_per_sync],
            "first_sync_gbps": round(self.first_sync_gbps, 3),
            "best_gbps": round(self.best_gbps, 3),
        }


@dataclasses.dataclass(slots=True)
class BenchReport:
    """Everything one run measured."""

    memcpy_gbps: float
    total_bytes: int
    num_tensors: int
    largest_tensor_bytes: int
    results: list[MethodResult]
    device: str = "cpu"
    h2d_gbps: float | None = None
    """device cuda: one pinned host-to-device copy of the memcpy buffer's size, best of 3, GB/s."""

    def to_json(self) -> dict[str, Any]:
        return {
            "memcpy_gbps": round(self.memcpy_gbps, 3),
            "device": self.device,
            "h2d_gbps": None if self.h2d_gbps is None else round(self.h2d_gbps, 3),
            "results": [result.to_json(self.memcpy_gbps) for result in self.results],
            "total_bytes": self.total_bytes,
            "num_tensors": self.num_tensors,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "environment": environment(),
        }


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "libc": " ".join(platform.libc_ver()),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "copy_routine": "native streaming stores" if STREAMING_COPY else "numpy.copyto",
    }


# --- the synthetic model ------------------------------------------------------------------------

Shapes = list[tuple[str, tuple[int, ...]]]


def model_shapes(size_bytes: int) -> Shapes:
    """A decoder-only transformer of about `size_bytes` in bf16, shaped like Llama/Qwen models.

    The hidden size grows with the square root of the target so that the two vocabulary matrices
    (64 * hidden rows each) stay about a quarter of the model and larger than a 64 MiB bucket from
    about 1 GiB on; each layer holds mid-size attention and MLP matrices, q/k/v biases and norms.
    """
    hidden = max(64, round(math.sqrt(size_bytes / 1024) / 64) * 64)
    vocab, kv, ffn = 64 * hidden, hidden // 4, 4 * hidden
    layer: Shapes = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.q_proj.bias", (hidden,)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.k_proj.bias", (kv,)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.bias", (kv,)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("post_attention_layernorm.weight", (hidden,)),
        ("mlp.gate_proj.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", (hidden, ffn)),
    ]
    itemsize = DTYPE.itemsize
    layer_bytes = sum(math.prod(shape) for _, shape in layer) * itemsize
    fixed_bytes = (2 * vocab * hidden + hidden) * itemsize
    num_layers = max(1, (size_bytes - fixed_bytes) // layer_bytes)
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for index in range(num_layers):
        shapes += [(f"model.layers.{index}.{name}", shape) for name, shape in layer]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def allocate(shapes: Shapes) -> dict[str, torch.Tensor]:
    """Resident tensors (every page written once), as an engine's loaded weights are."""
    return {name: torch.empty(shape, dtype=DTYPE).fill_(1.0) for name, shape in shapes}


_BLOCK_BYTES = 1 << 20
_GROUP_BYTES = 16 * _BLOCK_BYTES
_MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=4)
def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 64, size=_BLOCK_BYTES // 8, dtype=np.uint64)


def _keys(seed: int, version: int, tensor: int, first_block: int, count: int) -> np.ndarray:
    """One 64-bit key per 1 MiB block: splitmix64 of (seed, version, tensor, block)."""
    base = (((seed * 1_000_003 + version) * 1_000_003 + tensor) << 24) & _MASK
    z = np.arange(first_block, first_block + count, dtype=np.uint64) + np.uint64(base)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _write_pattern(out: np.ndarray, seed: int, version: int, tensor: int, first_block: int) -> None:
    """Write the content of `tensor`'s bytes from block `first_block` on into `out` (uint8):
    each 1 MiB block is the seed's random block XOR that block's key."""
    whole = len(out) // _BLOCK_BYTES
    keys = _keys(seed, version, tensor, first_block, whole + 1)
    if whole:
        rows = out[: whole * _BLOCK_BYTES].view(np.uint64).reshape(whole, -1)
        np.bitwise_xor(_block(seed)[None, :], keys[:whole, None], out=rows)
    rest = len(out) - whole * _BLOCK_BYTES
    if rest:
        out[whole * _BLOCK_BYTES :] = (_block(seed) ^ keys[whole]).view(np.uint8)[:rest]


def _groups(data: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, len(data), _GROUP_BYTES):
        yield start // _BLOCK_BYTES, data[start : start + _GROUP_BYTES]


def fill(tensors: dict[str, torch.Tensor], seed: int, version: int) -> None:
    """Give every tensor the content of `version`, distinct per tensor and per block."""
    for index, tensor in enumerate(tensors.values()):
        for first_block, group in _groups(byte_view(tensor)):
            _write_pattern(group, seed, version, index, first_block)


def verify(tensors: dict[str, torch.Tensor], seed: int, version: int) -> bool:
    """True when every byte of every tensor is what `fill(tensors, seed, version)` writes."""
    scratch = np.empty(_GROUP_BYTES, dtype=np.uint8)
    for index, tensor in enumerate(tensors.values()):
        for first_block, group in _groups(byte_view(tensor)):
            expected = scratch[: len(group)]
            _write_pattern(expected, seed, version, index, first_block)
            if not np.array_equal(group, expected):
                return False
    return True


# --- measurements --------------------------------------------------------------------------------


def memcpy_gbps(num_bytes: int = GIB, rounds: int = 3) -> float:
    """Single-thread `numpy.copyto` between two pre-faulted buffers, best of `rounds`, GB/s."""
    source = np.ones(num_bytes, dtype=np.uint8)
    target = np.ones(num_bytes, dtype=np.uint8)
    best = math.inf
    for _ in range(rounds):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def h2d_gbps(num_bytes: int = GIB, rounds: int = 3) -> float:
    """One pinned host-to-device copy of `num_bytes` (the best a bucket can cross PCIe), best of `rounds`, GB/s."""
    source = torch.ones(num_bytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    best = math.inf
    for _ in range(rounds):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


class PeakRss:
    """Growth of this process's peak RSS between `start()` and `stop()`, in bytes."""

    def __init__(self) -> None:
        self._before = 0
        self._sampled = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # reset VmHWM to the current RSS
            self._before = _status_bytes("VmRSS")
        except OSError:
            self._start_sampling()

    def _start_sampling(self) -> None:
        process = psutil.Process()
        self._before = self._sampled = process.memory_info().rss
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self._sampled = max(self._sampled, process.memory_info().rss)

        self._sampler = threading.Thread(target=sample, daemon=True, name="weightsync-bench-rss")
        self._sampler.start()

    def stop(self) -> int:
        if self._sampler is None:
            return max(0, _status_bytes("VmHWM") - self._before)
        self._stop.set()
        self._sampler.join()
        self._sampler = None
        self._sampled = max(self._sampled, psutil.Process().memory_info().rss)
        return max(0, self._sampled - self._before)


# --- the receiving processes ---------------------------------------------------------------------


class _ReceiverSide:
    """What a receiver process does on command; runs in the spawned process."""

    def __init__(self, shapes: Shapes, queue: Any, seed: int, timeout: float, device: str) -> None:
        self.dest = {name: tensor.to(device) for name, tensor in allocate(shapes).items()}
        self.queue = queue
        self.seed = seed
        self.timeout = timeout
        self.receiver: WeightReceiver | None = None
        self.peak = PeakRss()

    def listen(self, transport: str, max_bucket_bytes: int | None) -> str:
        self.close_receiver()
        self.receiver = WeightReceiver(
            self.dest, transport, max_bucket_bytes=max_bucket_bytes or "auto", timeout=self.timeout
        )
        return self.receiver.address

    def close_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def arm(self) -> None:
        self.peak.start()

    def check(self, version: int) -> tuple[bool, int]:
        growth = self.peak.stop()
        committed = self.receiver is None or self.receiver.version == version
        landed = {name: tensor.cpu() for name, tensor in self.dest.items()}  # no copy on the CPU
        return committed and verify(landed, self.seed, version), growth

    def load(self, method: str, path: str) -> float:
        """Run a baseline's receiving half; returns the time its last copy finished."""
        _RECEIVE[method](self, path)
        return time.perf_counter()

    def _copy_all(self, get: Callable[[str], torch.Tensor]) -> None:
        for name, tensor in self.dest.items():
            tensor.copy_(get(name))

    def _receive_torch_save(self, path: str) -> None:
        self._copy_all(torch.load(path, weights_only=True).__getitem__)

    def _receive_safetensors(self, path: str) -> None:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as file:
            self._copy_all(file.get_tensor)

    def _receive_pickle(self, path: str) -> None:
        for _ in self.dest:
            name, payload = self.queue.get(timeout=self.timeout)
            self.dest[name].copy_(pickle.loads(payload))

    def _receive_shared(self, path: str) -> None:
        self._copy_all(self.queue.get(timeout=self.timeout).__getitem__)


_RECEIVE: dict[str, Callable[[_ReceiverSide, str], None]] = {
    "torch_save": _ReceiverSide._receive_torch_save,
    "safetensors": _ReceiverSide._receive_safetensors,
    "mp_queue_pickle": _ReceiverSide._receive_pickle,
    "mp_queue_shared": _ReceiverSide._receive_shared,
}


def _receiver_main(conn: Connection, shapes: Shapes, queue: Any, seed: int, timeout: float, device: str) -> None:
    side = _ReceiverSide(shapes, queue, seed, timeout, device)
    conn.send(("ok", os.getpid()))
    while True:
        command, *args = conn.recv()
        if command == "exit":
            break
        try:
            conn.send(("ok", getattr(side, command)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    side.close_receiver()


class _Worker:
    """The parent's handle on one receiver process."""

    def __init__(self, context: Any, shapes: Shapes, seed: int, timeout: float, device: str = "cpu") -> None:
        self.queue = context.Queue(maxsize=2)
        self.conn, child = context.Pipe()
        self.timeout = timeout
        self.process = context.Process(
            target=_receiver_main, args=(child, shapes, self.queue, seed, timeout, device), daemon=True
        )
        self.process.start()
        child.close()

    def send(self, command: str, *args: Any) -> None:
        self.conn.send((command, *args))

    def reply(self, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                raise BenchError(f"receiver process {self.process.pid} died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise BenchError(f"receiver process {self.process.pid} did not answer in time")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"receiver process {self.process.pid} closed its pipe") from None
        if status != "ok":
            raise BenchError(f"receiver process {self.process.pid} failed:\n{value}")
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("exit")
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.queue.close()
        self.queue.cancel_join_thread()
        self.conn.close()


def _broadcast(workers: Sequence[_Worker], command: str, *args: Any) -> list[Any]:
    """Run a command on every worker at once; their replies in order."""
    for worker in workers:
        worker.send(command, *args)
    return [worker.reply() for worker in workers]


# --- the runs ------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Run:
    config: BenchConfig
    source: dict[str, torch.Tensor]
    workers: list[_Worker]
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


def _run_weightsync(run: _Run, transport: str, num_receivers: int) -> MethodResult:
    config, workers = run.config, run.workers[:num_receivers]
    result = MethodResult("weightsync", transport, num_receivers, run.total_bytes)
    addresses = _broadcast(workers, "listen", transport, config.bucket_bytes)
    sender = WeightSender(
        addresses,
        bucket_bytes=config.bucket_bytes or "auto",
        timeout=config.timeout,
        num_slots=config.num_slots,
        verify=config.verify,
    )
    peak = PeakRss()
    try:
        for _ in range(config.repeat):
            run.step(f"weightsync {transport} x{num_receivers}")
            version = run.next_version()
            _broadcast(workers, "arm")
            peak.start()
            report = sender.push(run.source, version)
            result.sender_rss_growth.append(peak.stop())
            checks = _broadcast(workers, "check", version)
            result.seconds_per_sync.append(report.seconds)
            result.bucket_bytes = report.bucket_bytes
            result.receiver_rss_growth.append(max(growth for _, growth in checks))
            result.verified_syncs.append(report.ok and all(ok for ok, _ in checks))
    finally:
        sender.close()
        _broadcast(workers, "close_receiver")
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


def _check_memory(config: BenchConfig, total_bytes: int) -> None:
    """Refuse a run that cannot fit rather than let the machine swap or kill it: the source,
    every receiver's destinations and, for the baselines, a file plus a loaded copy."""
    copies = 1 + max(config.receivers) + (2 if config.baselines else 0)
    need = copies * total_bytes
    available = psutil.virtual_memory().available
    if need > 0.8 * available:  # leave room for rings, page tables, and whatever else runs here
        fits = 0.8 * available / (copies * GIB)
        raise ResourceError(
            f"this run needs about {need / GIB:.1f} GiB ({copies} copies of {total_bytes / GIB:.2f} GiB), "
            f"{available / GIB:.1f} GiB are available; use a size of at most {fits:.2f} GiB (--size-gb)"
        )


def run(config: BenchConfig) -> BenchReport:
    """Measure memcpy, then every configured transport and receiver count, then the baselines.

    Can be called in-process with tiny sizes (e.g. `BenchConfig(size_bytes=8 << 20, repeat=1,
    memcpy_bytes=8 << 20)`); receivers are always separate spawned processes.
    """
    from tqdm import tqdm

    shapes = model_shapes(config.size_bytes)
    total_bytes = sum(math.prod(shape) for _, shape in shapes) * DTYPE.itemsize
    _check_memory(config, total_bytes)
    num_steps = config.repeat * (len(config.transports) * len(config.receivers) + config.baselines * len(BASELINES))
    bar = tqdm(total=num_steps + 2, file=sys.stderr, disable=not config.progress, unit="step", leave=False)

    def step(what: str) -> None:
        bar.set_description(what)
        bar.update(1)

    context = multiprocessing.get_context("spawn")
    workers: list[_Worker] = []
    try:
        step("memcpy")
        reference = memcpy_gbps(config.memcpy_bytes)
        step("starting receivers")
        workers = [
            _Worker(context, shapes, config.seed, config.timeout, config.device) for _ in range(max(config.receivers))
        ]
        host = allocate(shapes)
        source = host if config.device == "cpu" else {name: t.to(config.device) for name, t in host.items()}
        h2d = h2d_gbps(config.memcpy_bytes) if config.device == "cuda" else None
        for worker in workers:
            worker.reply(timeout=max(300.0, config.timeout))
        state = _Run(config, source, workers, total_bytes, step, host if config.device != "cpu" else None)
        results = [
            _run_weightsync(state, transport, count) for transport in config.transports for count in config.receivers
        ]
        if config.baselines:
            results += [_run_baseline(state, method) for method in BASELINES]
    finally:
        for worker in workers:
            worker.stop()
        bar.close()
    largest = max(math.prod(shape) for _, shape in shapes) * DTYPE.itemsize
    return BenchReport(reference, total_bytes, len(shapes), largest, results, config.device, h2d)


# --- output --------------------------------------------------------------------------------------

_COLUMNS = (
    ("method", "<"),
    ("transport", "<"),
    ("receivers", ">"),
    ("GB/s", ">"),
    ("x memcpy", ">"),
    ("first GB/s", ">"),
    ("bucket MiB", ">"),
    ("sender RSS+ MiB", ">"),
    ("receiver RSS+ MiB", ">"),
    ("verified", "<"),
    ("s/sync", "<"),
)


def _row(result: MethodResult, memcpy: float) -> list[str]:
    return [
        result.method,
        result.transport or "-",
        str(result.receivers),
        f"{result.gbps:.2f}",
        f"{result.gbps / memcpy:.2f}",
        f"{result.first_sync_gbps:.2f}",
        f"{result.bucket_bytes / MIB:g}" if result.bucket_bytes else "-",
        f"{max(result.sender_rss_growth) / MIB:.0f}",
        f"{max(result.receiver_rss_growth) / MIB:.0f}",
        "yes" if result.verified else "NO",
        " ".join(f"{s:.3f}" for s in result.seconds_per_sync),
    ]


def format_table(report: BenchReport) -> str:
    """The results as a plain-text table, with a header line naming the model and the memcpy."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(result, report.memcpy_gbps) for result in report.results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(f"{cell:{align}{width}}" for cell, (_, align), width in zip(row, _COLUMNS, widths, strict=True))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    header = (
        f"model: {report.total_bytes / GIB:.2f} GiB bf16, {report.num_tensors} tensors, "
        f"largest {report.largest_tensor_bytes / MIB:.0f} MiB; "
        f"memcpy (numpy.copyto, 1 thread, pre-faulted): {report.memcpy_gbps:.2f} GB/s; "
        f"weightsync copies with {'native streaming stores' if STREAMING_COPY else 'numpy.copyto'}; "
        f"GB/s = median over syncs, 1e9 bytes of payload per second end to end"
    )
    if report.device != "cpu":
        header += (
            f"\nsource and destinations on {report.device}; "
            f"pinned host-to-device copy (torch, one buffer of the memcpy's size): {report.h2d_gbps:.2f} GB/s"
        )
    return "\n".join([header, "", *(line.rstrip() for line in lines)])
