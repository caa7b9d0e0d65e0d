"""Shared test helpers: deterministic tensors, a recording sink, bit-exact comparison, and the
hypothesis strategies the contract suite draws tensor sets from."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

from weightsync import SyncReport, WeightReceiver, WeightSender, WeightSink
from weightsync.source import SourceLayout, TensorMeta, chunk_rows

TRANSPORTS = ["inproc", "shm", "tcp", "collective", "nixl"]
"""Every transport; inproc first, as the reference. (cudaipc needs CUDA: tests add it with the
`gpu` marker.) A case of a transport whose optional package is missing is skipped (conftest)."""

PROCESS_TRANSPORTS = ["shm", "tcp", "collective", "nixl"]
"""The transports whose peers can live in other processes."""

OPTIONAL_TRANSPORTS = {"nixl": "nixl"}
"""Transport -> the optional package it needs (`pip install 'weightsync[nixl]'`)."""


def missing_package(transport: str) -> str | None:
    """The optional package `transport` needs and this environment lacks, or None."""
    package = OPTIONAL_TRANSPORTS.get(transport)
    if package is None:
        return None
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: blocked by a None entry in sys.modules
        found = False
    return None if found else package


def needs(transport: str) -> pytest.MarkDecorator:
    """Skip a test of `transport` (one not parametrized by transport) where its package is missing."""
    package = missing_package(transport)
    return pytest.mark.skipif(
        package is not None, reason=f"{package} is not installed: pip install 'weightsync[{transport}]'"
    )


def installed(transports: list[str]) -> list[str]:
    """`transports` less those whose optional package is missing here."""
    return [transport for transport in transports if missing_package(transport) is None]


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]

ENGINES = [
    "hf",
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
            # vLLM's own imports warn (deprecated torch.jit APIs, future changes): not ours to fix.
            pytest.mark.filterwarnings("ignore::FutureWarning"),
            pytest.mark.filterwarnings("ignore::DeprecationWarning"),
            pytest.mark.filterwarnings("ignore::UserWarning"),
        ],
    ),
]
"""The rollout engines a server test runs on: hf always, vLLM where it is installed."""

SHM_DIR = "/dev/shm"

WAIT_S = 10.0
"""Every bounded wait in the tests: far above what any step takes, far below a hang."""


def wait_until(predicate: Callable[[], object], timeout: float = WAIT_S, interval: float = 0.01) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        time.sleep(interval)
    return True


def shm_segments(pid: int | None = None) -> set[str]:
    """Names of weightsync's shared-memory segments present right now; with `pid`, only those
    that process created (another test run on this host may hold segments of its own)."""
    prefix = "weightsync-" if pid is None else f"weightsync-{pid}-"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of random bytes (any bit pattern, NaN payloads included; 0/1 for bool)."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def random_values(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Ordinary finite values (for casts, where NaN payloads would not be comparable)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)


def non_contiguous(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as `tensor`, laid out non-contiguously ("transposed" or "strided")."""
    if layout == "contiguous" or tensor.dim() == 0:
        return tensor
    if layout == "transposed":
        dims = list(range(tensor.dim()))[::-1]
        return tensor.permute(*dims).contiguous().permute(*dims)
    if layout == "strided":
        wide = torch.zeros((*tensor.shape[:-1], tensor.shape[-1] * 2), dtype=tensor.dtype)
        wide[..., ::2] = tensor
        return wide[..., ::2]
    raise ValueError(layout)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    # a fresh tensor: `contiguous()` keeps odd strides on empty and one-element tensors
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Same dtype, same shape, and the same bytes (NaN payloads and -0.0 included)."""
    assert actual.dtype == expected.dtype, f"{name!r}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{name!r}: shape {actual.shape} != {expected.shape}"
    assert raw_bytes(actual) == raw_bytes(expected), f"{name!r}: bytes differ"


def assert_all_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert_bit_exact(actual[name], tensor, name)


class Recorder(WeightSink):
    """A sink that records every hook call and keeps a copy of every tensor handed to `load`.

    Args:
        dest: destination tensors by name (written in place); names without one go to `load`.
        gate: if set, `load` waits on it (bounded) before taking tensors, to hold a sync open.
        fail_load: an exception `load` raises (after the gate).
    """

    def __init__(
        self,
        dest: dict[str, torch.Tensor] | None = None,
        *,
        gate: threading.Event | None = None,
        fail_load: BaseException | None = None,
    ) -> None:
        self.dest = dest
        self.gate = gate
        self.fail_load = fail_load
        self.loading = threading.Event()
        """Set when `load` is first entered."""
        self.received: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, object]] = []
        self.plans: list[object] = []
        self.aborts: list[tuple[int, BaseException]] = []
        self.aborted = threading.Event()

    def reset(self, dest: dict[str, torch.Tensor] | None = None) -> None:
        self.dest = dest
        self.received = {}
        self.calls = []
        self.plans = []
        self.aborts = []
        self.aborted.clear()

    def begin(self, plan, version):  # type: ignore[no-untyped-def]
        self.calls.append(("begin", version))
        self.plans.append(plan)

    def destination(self, name):  # type: ignore[no-untyped-def]
        return None if self.dest is None else self.dest.get(name)

    def load(self, named_tensors):  # type: ignore[no-untyped-def]
        self.loading.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "test gate never opened"
        if self.fail_load is not None:
            raise self.fail_load
        self.calls.append(("load", [name for name, _ in named_tensors]))
        for name, tensor in named_tensors:
            self.received[name] = tensor.clone()

    def commit(self, version):  # type: ignore[no-untyped-def]
        self.calls.append(("commit", version))

    def abort(self, version, error, *, intact):  # type: ignore[no-untyped-def]
        self.calls.append(("abort", version))
        self.aborts.append((version, error))
        self.aborted.set()

    def hooks(self) -> list[str]:
        return [call[0] for call in self.calls]


@contextlib.contextmanager
def receiving(sink: object, transport: str, **kwargs: object) -> Iterator[WeightReceiver]:
    kwargs.setdefault("timeout", 10.0)
    receiver = WeightReceiver(sink, transport=transport, **kwargs).start()
    try:
        yield receiver
    finally:
        receiver.close()


@contextlib.contextmanager
def sending(addresses: list[str] | str, **kwargs: object) -> Iterator[WeightSender]:
    kwargs.setdefault("timeout", 10.0)
    sender = WeightSender(addresses, **kwargs)
    try:
        yield sender
    finally:
        sender.close()


# --- hypothesis strategies --------------------------------------------------------------------

names = st.text(min_size=1, max_size=16)
"""Tensor names: any unicode text (hypothesis leaves out lone surrogates, which are not text)."""

shapes = st.one_of(
    st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),  # 0-dim, empty and small
    st.integers(0, 300).map(lambda n: (n,)),  # long enough to chunk over small buckets
)

layouts = st.sampled_from(["contiguous", "transposed", "strided"])


@st.composite
def tensor_sets(draw: st.DrawFn, max_tensors: int = 6) -> dict[str, torch.Tensor]:
    """Named tensors of every dtype and layout, some of them tied (one tensor under two names)."""
    tensor_names = draw(st.lists(names, max_size=max_tensors, unique=True))
    out: dict[str, torch.Tensor] = {}
    for index, name in enumerate(tensor_names):
        if out and draw(st.integers(0, 7)) == 0:
            out[name] = out[draw(st.sampled_from(sorted(out)))]  # tied, as embed/lm_head
            continue
        base = random_tensor(draw(st.sampled_from(DTYPES)), draw(shapes), seed=draw(st.integers(0, 2**31)) + index)
        out[name] = non_contiguous(base, draw(layouts))
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RowShards:
    """Rank `rank` of `world`: holds `torch.chunk`'s rows of every tensor of two or more
    dimensions, and every smaller one whole (as FSDP2 shards a model with `Shard(0)`)."""

    def __init__(self, full: dict[str, torch.Tensor], rank: int, world: int, fail_at: str = "") -> None:
        self.full, self.rank, self.world, self.fail_at = full, rank, world, fail_at

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self.full.items()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.full.items())

    def layout(self) -> SourceLayout:
        rows = tuple(chunk_rows(t.shape[0], self.world) if t.dim() > 1 else None for t in self.full.values())
        return SourceLayout.from_rows(self.rank, self.world, rows)

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        rows = (chunk_rows(t.shape[0], self.world) if t.dim() > 1 else None for t in self.full.values())
        for (name, tensor), bounds in zip(self.full.items(), rows, strict=True):
            if name == self.fail_at:
                raise RuntimeError(f"rank {self.rank} lost {name}")
            yield name, tensor if bounds is None else tensor[bounds[self.rank] : bounds[self.rank + 1]]


def push_from_ranks(addresses: list[str], sources: list[Any], version: int, **options: Any) -> list[SyncReport]:
    """Each source pushed by a `WeightSender(addresses, **options)` of its own, on a thread of
    its own (as the ranks of a trainer do); the first error a push raised is raised here, once
    every push ended."""

    def push(rank: int) -> SyncReport:
        with WeightSender(addresses, **options) as sender:
            return sender.push(sources[rank], version=version)

    return pushes_on_threads(push, len(sources), 4 * float(options.get("timeout", WAIT_S)))


def pushes_on_threads(push: Callable[[int], SyncReport], ranks: int, timeout: float) -> list[SyncReport]:
    """`push(rank)` for every rank, each on a thread of its own, each joined within `timeout`;
    the first error a push raised is raised here, once every push ended."""
    reports: list[SyncReport | None] = [None] * ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            reports[rank] = push(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert all(report is not None for report in reports), "a rank's push did not end"
    return [report for report in reports if report is not None]
