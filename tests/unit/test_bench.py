"""`weightsync bench` end to end at a tiny size, and its configuration errors."""

from __future__ import annotations

import pytest
import torch

from weightsync.bench import MIB, BenchConfig, format_table, run
from weightsync.errors import ConfigError


def test_a_tiny_run_verifies_every_byte_on_each_transport():
    report = run(
        BenchConfig(
            size_bytes=8 * MIB, repeat=2, memcpy_bytes=MIB, transports=("shm", "tcp", "collective"), baselines=False
        )
    )
    assert [(r.transport, r.receivers) for r in report.results] == [("shm", 1), ("tcp", 1), ("collective", 1)]
    assert all(result.verified and len(result.seconds_per_sync) == 2 for result in report.results)
    table = format_table(report)
    assert table.count("\nweightsync ") == 3 and "yes" in table
    assert report.to_json()["device"] == "cpu" and report.to_json()["h2d_gbps"] is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"device": "tpu"}, "device must be cpu or cuda"),
        ({"transports": ("carrier-pigeon",)}, "unknown transport"),
        ({"receivers": (0,)}, "positive counts"),
        ({"transports": ("cudaipc",), "baselines": False}, "run it with device cuda"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**changes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_a_gpu_says_so():
    with pytest.raises(ConfigError, match="no CUDA device"):
        BenchConfig(device="cuda", baselines=False)
