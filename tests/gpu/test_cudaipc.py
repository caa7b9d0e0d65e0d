"""cudaipc: a trainer and rollout processes sharing one GPU, buckets never leaving it.

CUDA IPC refuses to open a handle in the process that made it, so every receiver here is a child
process. It reports the content digest of what it holds (`weightsync.digest.source_digest`, the
same digest a verified push carries), which must equal the source's.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.helpers import random_tensor, random_values, sending
from weightsync import TensorMeta
from weightsync.digest import source_digest
from weightsync.transports import cudaipc

pytestmark = pytest.mark.gpu  # skipped where torch sees no CUDA (tests/conftest.py)

BUCKET = 1 << 16

REPLY_S = 60.0
"""How long a child may take to answer: its own waits are bounded at 30 s, plus CUDA start-up."""

RECEIVER = r"""
import json, sys, time, torch
from weightsync import WeightReceiver
from weightsync.digest import source_digest
specs, bucket = json.loads(sys.argv[1]), int(sys.argv[2])
dest = {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for name, shape, dtype, device in specs}
receiver = WeightReceiver(dest, transport="cudaipc", timeout=30).start()
print("ADDRESS", receiver.address, flush=True)
for line in sys.stdin:
    version, deadline = int(line), time.monotonic() + 30
    while receiver.version != version and time.monotonic() < deadline:
        time.sleep(0.005)
    print("DIGEST", receiver.version, receiver.state, source_digest(dest), flush=True)
receiver.close()
"""


class Receiver:
    """A receiving child process: `digest(version)` waits for that version and returns its digest."""

    def __init__(self, source: dict[str, torch.Tensor], dest_device: str = "cuda") -> None:
        specs = [
            [name, list(t.shape), str(t.dtype).removeprefix("torch."), "cpu" if name.endswith("cpu") else dest_device]
            for name, t in source.items()
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, json.dumps(specs), str(BUCKET)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="cudaipc-test-child-stdout").start()
        self.address = self._line("ADDRESS").split()[1]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("<exited>")

    def _line(self, prefix: str) -> str:
        """The child's next line, within `REPLY_S`: a child that hangs fails the test, not the run."""
        try:
            line = self._lines.get(timeout=REPLY_S)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"the receiving child said nothing for {REPLY_S} s (waiting for {prefix})") from None
        assert line.startswith(prefix), f"child said {line!r}"
        return line

    def digest(self, version: int) -> tuple[int, str, str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{version}\n")
        self.proc.stdin.flush()
        _, held, state, digest = self._line("DIGEST").split()
        return int(held), state, digest

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def model() -> dict[str, torch.Tensor]:
    """Chunked (4.5 buckets), non-contiguous, 0-dim, fp8, empty, and one tensor whose receiver
    keeps it in host memory (device to host out of the GPU ring)."""
    named = {
        "embed.weight": random_tensor(torch.bfloat16, (9 * BUCKET // 4,), seed=1).reshape(-1, 64),
        "layers.0.q.weight": random_tensor(torch.float16, (96, 128), seed=2).t(),
        "layers.0.step": random_tensor(torch.int64, (), seed=4),
        "layers.0.fp8": random_tensor(torch.float8_e4m3fn, (257,), seed=6),
        "empty": random_tensor(torch.float32, (0, 7), seed=7),
        "norm.on_cpu": random_tensor(torch.float32, (300,), seed=8),
    }
    return {name: t.cuda() for name, t in named.items()}


@pytest.mark.parametrize("verify", ["off", "bucket"])
def test_gpu_to_gpu_through_a_shared_gpu_ring_bit_exact_over_versions(verify):
    source = model()
    receiver = Receiver(source)
    try:
        with sending(receiver.address, bucket_bytes=BUCKET, verify=verify, timeout=30.0) as sender:
            for version in (1, 2, 3):
                source["embed.weight"].add_(1)
                report = sender.push(source, version=version)
                assert report.ok, report.failed
                assert report.num_buckets > 4, "the embedding is chunked across buckets"
                assert receiver.digest(version) == (version, "ready", source_digest(source))
    finally:
        receiver.close()


def test_one_gpu_ring_feeds_several_receivers():
    source = model()
    receivers = [Receiver(source) for _ in range(3)]
    try:
        with sending([r.address for r in receivers], bucket_bytes=BUCKET, num_slots=3, timeout=30.0) as sender:
            for version in (1, 2):
                source["layers.0.q.weight"].mul_(2)
                assert sender.push(source, version=version).ok
                expected = (version, "ready", source_digest(source))
                assert [r.digest(version) for r in receivers] == [expected] * 3
    finally:
        for receiver in receivers:
            receiver.close()


def test_a_host_source_goes_up_to_the_gpu_ring():
    host = {name: t.cpu() for name, t in model().items()}
    receiver = Receiver(host)
    try:
        with sending(receiver.address, bucket_bytes=BUCKET, timeout=30.0) as sender:
            assert sender.push(host, version=1).ok
            assert receiver.digest(1) == (1, "ready", source_digest(host))
    finally:
        receiver.close()


# --- the direct path: held tensors read in place ---------------------------------------------------


class NotHeld:
    """The same tensors from a source that does not hold them (as a generator would)."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self._named = named

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self._named.items()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._named.items())


def counting_shares(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every storage the sender (this process) shares by CUDA IPC, as it shares it."""
    shared: list[int] = []
    real = cudaipc.share_storage

    def share(storage: torch.UntypedStorage) -> cudaipc.CudaHandle:
        shared.append(storage.data_ptr())
        return real(storage)

    monkeypatch.setattr(cudaipc, "share_storage", share)
    return shared


def held_model() -> dict[str, torch.Tensor]:
    """model() less its empty tensor: every tensor can be read in place, so no ring is made."""
    return {name: t for name, t in model().items() if t.numel()}


@pytest.mark.parametrize("verify", ["off", "bucket"])
def test_held_tensors_are_shared_once_and_again_when_their_storage_changes(verify, monkeypatch):
    source = held_model()
    shared = counting_shares(monkeypatch)
    receiver = Receiver(source)
    try:
        with sending(receiver.address, bucket_bytes=BUCKET, verify=verify, timeout=30.0) as sender:
            for version in (1, 2, 3):
                source["embed.weight"].add_(1)  # an optimizer step: in place
                assert sender.push(source, version=version).ok
                assert receiver.digest(version) == (version, "ready", source_digest(source))
                assert len(shared) == len(source), "each storage shared once, no ring slot"
            source["layers.0.q.weight"] = source["layers.0.q.weight"] * 2  # a new storage
            assert sender.push(source, version=4).ok
            assert receiver.digest(4) == (4, "ready", source_digest(source))
            assert len(shared) == len(source) + 1, "only the changed storage is shared again"
    finally:
        receiver.close()


def test_a_source_that_does_not_hold_its_tensors_goes_through_the_gpu_ring(monkeypatch):
    source = held_model()
    shared = counting_shares(monkeypatch)
    receiver = Receiver(source)
    try:
        with sending(receiver.address, bucket_bytes=BUCKET, timeout=30.0) as sender:
            for version in (1, 2):
                source["embed.weight"].add_(1)
                assert sender.push(NotHeld(source), version=version).ok
                assert receiver.digest(version) == (version, "ready", source_digest(source))
        assert len(shared) == 2, "the two ring slots, shared once; no tensor"
    finally:
        receiver.close()


def test_fp32_master_weights_are_cast_to_bf16_by_the_receiver_on_the_device():
    master = {f"w{i}": random_values(torch.float32, (3 * BUCKET // 8 + i,), seed=i).cuda() for i in range(4)}
    master["t"] = random_values(torch.float32, (64, 48), seed=9).cuda().t()
    cast = {name: t.to(torch.bfloat16) for name, t in master.items()}
    receiver = Receiver(cast)
    try:
        with sending(receiver.address, bucket_bytes=BUCKET, cast=torch.bfloat16, timeout=30.0) as sender:
            assert sender.push(master, version=1).ok
        assert receiver.digest(1) == (1, "ready", source_digest(cast))
    finally:
        receiver.close()
