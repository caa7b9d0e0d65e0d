"""cudaipc: a trainer and rollout processes sharing one GPU, buckets never leaving it.

CUDA IPC refuses to open a handle in the process that made it, so every receiver here is a child
process. It reports the content digest of what it holds (`weightsync.digest.source_digest`, the
same xxh3 a verified push carries), which must equal the source's.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading

import pytest
import torch

from tests.helpers import random_tensor, sending
from weightsync.digest import source_digest

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
