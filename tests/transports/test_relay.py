"""A relay: one receiver takes each sync from the trainer and forwards it, as tensors complete,
to the receivers behind it (over shm here). Every server behind it ends bit-exact on the same
version; a failed upstream sync is aborted downstream too; a dead downstream server is reported
without holding the others back."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import WAIT_S, Recorder, assert_all_bit_exact, random_tensor, receiving, sending
from weightsync import PlanError, SenderOptions, SinkError, TensorMeta, WeightReceiver
from weightsync.relay import RelaySink


def model(seed: int) -> dict[str, torch.Tensor]:
    return {
        "embed": random_tensor(torch.bfloat16, (300, 64), seed=seed),  # 38 KiB: chunked over 16 KiB buckets
        "norm": random_tensor(torch.float32, (64,), seed=seed + 1),
        "ids": torch.arange(10, dtype=torch.int64) + seed,
    }


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in tensors.items()}


@pytest.mark.parametrize("upstream", ["tcp", "collective", "inproc"])
def test_every_server_behind_the_relay_gets_each_version_bit_exact(upstream):
    downstream = [zeros_like(model(0)) for _ in range(3)]
    own = zeros_like(model(0))
    servers = [WeightReceiver(dest, transport="shm", timeout=WAIT_S).start() for dest in downstream]
    relay_sink = RelaySink([s.address for s in servers], own, timeout=WAIT_S, sender=SenderOptions(bucket_bytes=8192))
    try:
        with (
            receiving(relay_sink, upstream) as relay,
            sending(relay.address, bucket_bytes=16384) as trainer,
        ):
            for version in (1, 2, 3):
                source = model(version)
                report = trainer.push(source, version)
                assert report.ok, report.failed
                assert relay_sink.last_report is not None and relay_sink.last_report.ok
                assert relay_sink.last_report.num_buckets > report.num_buckets, "its own, smaller buckets"
                assert relay.version == version and all(s.version == version for s in servers)
                for dest in [own, *downstream]:
                    assert_all_bit_exact(dest, source)
    finally:
        relay_sink.close()
        for server in servers:
            server.close()


def test_a_failed_upstream_sync_is_aborted_downstream():
    class Liar:
        def metas(self):  # type: ignore[no-untyped-def]
            return [TensorMeta("a", (4096,), torch.float32), TensorMeta("b", (4096,), torch.float32)]

        def tensors(self):  # type: ignore[no-untyped-def]
            yield "a", torch.full((4096,), 9.0)
            yield "b", torch.ones(5)

    behind = Recorder({"a": torch.zeros(4096), "b": torch.zeros(4096)})
    with receiving(behind, "shm") as server:
        relay_sink = RelaySink(server.address, timeout=WAIT_S)
        try:
            with receiving(relay_sink, "tcp") as relay, sending(relay.address, bucket_bytes=16384) as trainer:
                assert trainer.push({"a": torch.ones(4096), "b": torch.ones(4096)}, 1).ok
                with pytest.raises(PlanError):
                    trainer.push(Liar(), 2)
                assert relay.version == 1
            assert [version for version, _ in behind.aborts] == [2], "the server behind aborted version 2"
            assert server.version == 1 or server.state == "dirty", "never a version it does not hold intact"
            assert server.version != 2
        finally:
            relay_sink.close()


def test_a_dead_server_behind_the_relay_is_reported_and_the_others_commit():
    source = model(5)
    alive = zeros_like(source)
    with receiving(alive, "shm") as server, receiving(zeros_like(source), "shm") as doomed:
        relay_sink = RelaySink([server.address, doomed.address], timeout=WAIT_S)
        doomed_address = doomed.address
        doomed.close()
        try:
            with receiving(relay_sink, "tcp") as relay, sending(relay.address) as trainer:
                assert trainer.push(source, 1).ok, "the relay itself committed"
                report = relay_sink.last_report
                assert report is not None
                assert [(o.address, o.kind) for o in report.failed] == [(doomed_address, "ConnectError")]
                assert server.version == 1 and relay.version == 1
                assert_all_bit_exact(alive, source)
        finally:
            relay_sink.close()


def test_outside_a_sync_the_relay_refuses_tensors_and_commits_with_a_sink_error():
    """Its state guards are errors, not asserts (which `python -O` strips)."""
    relay = RelaySink(["inproc://weightsync-nobody"], timeout=WAIT_S)
    try:
        with pytest.raises(SinkError, match="outside a sync"):
            relay.load([("w", torch.zeros(1))])
        with pytest.raises(SinkError, match="no sync to finish"):
            relay.commit(1)
    finally:
        relay.close()
