"""`weightsync-bench` end to end at a tiny size, and its configuration errors."""

from __future__ import annotations

import pytest
import torch

from weightsync.errors import ConfigError
from weightsync_bench import MIB, BenchConfig, format_table, run


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


def test_a_callable_sink_lands_every_byte_and_is_set_against_a_loaders_own_copy():
    config = BenchConfig(
        size_bytes=8 * MIB, repeat=1, memcpy_bytes=MIB, transports=("shm",), sinks=("dict", "callable"), baselines=False
    )
    report = run(config)
    assert [(r.transport, r.sink) for r in report.results] == [("shm", "dict"), ("shm", "callable")]
    assert all(result.verified for result in report.results)
    assert report.loader_copy_gbps is not None and report.loader_copy_gbps > 0
    assert report.to_json()["loader_copy_gbps"] > 0
    assert "the ceiling of a callable sink" in format_table(report)


def test_a_dict_only_run_does_not_measure_a_loader_copy():
    report = run(BenchConfig(size_bytes=4 * MIB, repeat=1, memcpy_bytes=MIB, transports=("shm",), baselines=False))
    assert report.loader_copy_gbps is None and "callable" not in format_table(report)


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


def test_a_run_that_does_not_fit_says_which_size_does(monkeypatch):
    """The refusal used to read as a contradiction ("needs 15.8 GiB, 17.2 available"): it names
    the share of memory a run may use, and the size that fits."""
    import types

    from weightsync.errors import ResourceError
    from weightsync_bench import GIB, fitting_size_bytes, runs

    available = int(17.2 * GIB)
    monkeypatch.setattr(runs.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
    config = BenchConfig(size_bytes=4 * GIB)  # 4 copies with the baselines: about 16 GiB
    fits = fitting_size_bytes(config)
    assert fits == 3 * GIB + GIB // 4 and 4 * runs.model_bytes(fits) <= 0.8 * available
    with pytest.raises(ResourceError) as refused:
        run(config)  # refused before anything is built
    message = str(refused.value)
    assert "more than the 13.8 GiB it may use here (80% of the 17.2 GiB available now)" in message, message
    assert "--size-gb 3.25 fits" in message, message
    assert fitting_size_bytes(config, available=GIB // 2) == 0


def test_the_default_size_fits_the_machine(monkeypatch, capsys):
    """Plain `weightsync-bench` measures 4 GiB where it fits, and the largest size that fits where
    not (saying so), instead of refusing."""
    import types

    from weightsync_bench import GIB, args, cli, runs

    seen = {}

    def fake_run(config):  # noqa: ANN001, ANN202
        seen["size"] = config.size_bytes
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=int(17.2 * GIB)))
    monkeypatch.setattr("weightsync_bench.run", fake_run)
    assert cli.main([]) == 130
    assert seen["size"] == 3 * GIB + GIB // 4
    assert "4 GiB does not fit in the memory available now; measuring 3.25 GiB" in capsys.readouterr().err
    assert args.DEFAULT_SIZE_GB == 4.0


def test_a_tiny_delta_run_reports_modes_bytes_and_memcpy():
    from weightsync_bench.delta import format_delta_table, run_delta

    results = run_delta(["tcp"], 4 * MIB, lr=1e-6, steps=2, memcpy_bytes=MIB)
    assert [(r.step, r.delta_mode) for r in results] == [(0, "full"), (1, "delta"), (2, "delta")]
    assert all(r.memcpy_s > 0 and r.full_wire_bytes == 4 * MIB for r in results)
    assert all(0 < r.delta_wire_bytes < r.full_wire_bytes / 2 for r in results[1:])
    table = format_delta_table(results)
    assert "memcpy s" in table and "full/memcpy" in table and "median delta/full" in table
