"""Weights on a GPU: CUDA sources and CUDA destinations over every transport, bit for bit.

Skipped without CUDA (our CI has none); run on a GPU machine with `pytest tests/gpu`.
A CUDA source is read through torch (device-to-host into the bucket); a contiguous CUDA
destination is written piece by piece, host to device, straight from the transport's buffer
(`Landing.copy_in`/`read_in`), never staged whole on the host.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TRANSPORTS, assert_all_bit_exact, random_tensor, random_values, receiving, sending
from weightsync import hostpin, landing
from weightsync.errors import ConfigError
from weightsync.landing import Landing

pytestmark = pytest.mark.gpu  # skipped where torch sees no CUDA (tests/conftest.py)

BUCKET = 1 << 16


def model_like(device: str) -> dict[str, torch.Tensor]:
    """A small mix: chunked (4.5 buckets), non-contiguous, tied, 0-dim, empty, several dtypes."""
    big = random_tensor(torch.bfloat16, (9 * BUCKET // 4,), seed=1)
    named = {
        "embed.weight": big.reshape(-1, 64),
        "layers.0.q.weight": random_tensor(torch.float16, (96, 128), seed=2).t(),
        "layers.0.norm.weight": random_tensor(torch.float32, (128,), seed=3),
        "layers.0.step": random_tensor(torch.int64, (), seed=4),
        "layers.0.mask": random_tensor(torch.bool, (33,), seed=5),
        "layers.0.fp8": random_tensor(torch.float8_e4m3fn, (257,), seed=6),
        "empty": random_tensor(torch.float32, (0, 7), seed=7),
    }
    named = {name: tensor.to(device) for name, tensor in named.items()}
    named["lm_head.weight"] = named["embed.weight"]  # tied
    return named


def zeros_like_all(named: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(t.shape, dtype=t.dtype, device=device) for name, t in named.items()}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("source_device", "dest_device"), [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_round_trip_bit_exact(transport: str, source_device: str, dest_device: str) -> None:
    source = model_like(source_device)
    dest = zeros_like_all(source, dest_device)
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        report = sender.push(source, version=3)
    assert report.ok, report
    assert receiver.version == 3
    assert all(t.device.type == dest_device for t in dest.values())
    assert_all_bit_exact({k: v.cpu() for k, v in dest.items()}, {k: v.cpu() for k, v in source.items()})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp32_master_weights_cast_to_bf16_on_the_gpu(transport: str) -> None:
    master = {f"w{i}": random_values(torch.float32, (3 * BUCKET // 8 + i,), seed=i).cuda() for i in range(4)}
    dest = {name: torch.zeros(t.shape, dtype=torch.bfloat16, device="cuda") for name, t in master.items()}
    with (
        receiving(dest, transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, cast=torch.bfloat16) as sender,
    ):
        assert sender.push(master, version=1).ok
    expected = {name: t.to(torch.bfloat16).cpu() for name, t in master.items()}
    assert_all_bit_exact({k: v.cpu() for k, v in dest.items()}, expected)


def test_several_versions_into_the_same_cuda_destinations() -> None:
    dest = zeros_like_all(model_like("cpu"), "cuda")
    with receiving(dest, "shm") as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        for version in range(1, 4):
            # roll on the host: CUDA has no roll for fp8
            source = {name: (t.roll(version, 0) if t.dim() else t).cuda() for name, t in model_like("cpu").items()}
            assert sender.push(source, version=version).ok
            assert_all_bit_exact({k: v.cpu() for k, v in dest.items()}, {k: v.cpu() for k, v in source.items()})
    assert receiver.version == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("verify", ["off", "bucket", "full"])
def test_cuda_destinations_are_written_piece_by_piece_with_no_host_staging(transport, verify, monkeypatch):
    """A tensor larger than the bucket lands chunk by chunk in its CUDA destination: no
    full-size host tensor is ever made for it (the promise of one copy and no temporaries)."""
    staged: list[int] = []
    real_host_bytes = landing.host_bytes

    def recording_host_bytes(nbytes: int) -> torch.Tensor:  # every host buffer the landing allocates
        staged.append(nbytes)
        return real_host_bytes(nbytes)

    monkeypatch.setattr(landing, "host_bytes", recording_host_bytes)
    source = {"big": random_tensor(torch.bfloat16, (5 * BUCKET // 2 + 3,), seed=11), "norm": torch.randn(100)}
    source = {name: t.to("cuda") for name, t in source.items()}
    dest = zeros_like_all(source, "cuda")
    with (
        receiving(dest, transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, verify=verify) as sender,
    ):
        for version in (1, 2):
            source["big"].add_(1)
            report = sender.push(source, version=version)
            assert report.ok, report
            assert report.num_buckets >= 3, "the big tensor was chunked"
            assert_all_bit_exact({k: v.cpu() for k, v in dest.items()}, {k: v.cpu() for k, v in source.items()})
    assert staged == [], "a CUDA destination was staged in host memory"


def test_a_flipped_byte_on_the_way_to_a_cuda_destination_is_caught(monkeypatch):
    """verify="bucket" hashes what landed on the device (copied back), so corruption between the
    bucket and the GPU is caught, not just corruption on the wire."""
    real_copy_in = Landing.copy_in

    def corrupting_copy_in(self, piece, data, *, pinned=False, whole=None):  # type: ignore[no-untyped-def]
        data = data.clone() if isinstance(data, torch.Tensor) else data.copy()
        data[0] ^= 0xFF
        return real_copy_in(self, piece, data)  # a copy: neither pinned nor the transport's whole tensor

    monkeypatch.setattr(Landing, "copy_in", corrupting_copy_in)
    source = {"w": torch.randn(4 * BUCKET // 4, device="cuda")}
    dest = zeros_like_all(source, "cuda")
    with (
        receiving(dest, "shm") as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, verify="bucket", raise_on_failure=False) as sender,
    ):
        report = sender.push(source, version=1)
    assert not report.ok and report.failed[0].kind == "ChecksumError", report
    assert receiver.version is None


def test_bench_on_the_gpu_verifies_every_byte():
    from weightsync_bench import MIB, BenchConfig, run

    with pytest.raises(ConfigError, match="baselines run on cpu only"):
        BenchConfig(device="cuda")
    report = run(BenchConfig(size_bytes=8 * MIB, repeat=2, memcpy_bytes=MIB, baselines=False, device="cuda"))
    assert report.results and all(result.verified for result in report.results)
    assert report.h2d_gbps is not None and report.h2d_gbps > 0


@pytest.mark.parametrize("registration_works", [True, False], ids=["pinned", "cannot-pin"])
def test_shm_page_locks_its_ring_on_both_sides_for_cuda_tensors(registration_works, monkeypatch):
    """With CUDA on both ends the sender pins its ring and the receiver its read-only view of it,
    so buckets cross by DMA; where pinning fails, the bytes still arrive through staging."""
    calls: list[bool] = []
    real_pin = hostpin.pin

    def recording_pin(region, *, read_only=False):  # type: ignore[no-untyped-def]
        calls.append(read_only)
        return real_pin(region, read_only=read_only) if registration_works else False

    monkeypatch.setattr(hostpin, "pin", recording_pin)
    source = {name: t.to("cuda") for name, t in model_like("cpu").items()}
    dest = zeros_like_all(source, "cuda")
    with receiving(dest, "shm") as receiver, sending(receiver.address, bucket_bytes=BUCKET, num_slots=3) as sender:
        for version in (1, 2):
            assert sender.push(source, version=version).ok
            assert_all_bit_exact({k: v.cpu() for k, v in dest.items()}, {k: v.cpu() for k, v in source.items()})
    if registration_works:
        assert calls.count(False) == 3 and calls.count(True) == 3, "each side pinned its 3 slots, once"
    else:
        assert calls.count(False) == 1 and calls.count(True) == 1, "each side tried once, then stopped trying"
