"""StagedSink: a sync lands in a standby copy and reaches the engine's sink only at commit, so a
failure in transfer leaves the engine untouched (ready, previous version), while a failure in
the engine's own load at commit is reported as dirty."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Recorder, receiving, sending
from weightsync import PlanError, TensorMeta
from weightsync.sink import StagedSink


class Breaks:
    def metas(self):  # type: ignore[no-untyped-def]
        return [TensorMeta("a", (4096,), torch.float32), TensorMeta("b", (4096,), torch.float32)]

    def tensors(self):  # type: ignore[no-untyped-def]
        yield "a", torch.full((4096,), 7.0)
        yield "b", torch.ones(3)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_failure_in_transfer_never_reaches_the_engine(transport):
    engine = Recorder()  # no destinations: the engine takes tensors through load, like vLLM
    with receiving(StagedSink(engine, batch_bytes=4096), transport) as receiver:
        with sending(receiver.address, bucket_bytes=16384) as sender:
            good = {"a": torch.ones(4096), "b": torch.full((4096,), 2.0)}
            assert sender.push(good, 1).ok
            assert [hook for hook, _ in engine.calls].count("load") == 2, "handed over in 4 KiB batches"
            loads_before = len(engine.calls)
            with pytest.raises(PlanError):
                sender.push(Breaks(), 2)
        assert receiver.state == "ready" and receiver.version == 1
        assert all(hook != "load" for hook, _ in engine.calls[loads_before:]), "nothing reached the engine"
        assert torch.equal(engine.received["a"], torch.ones(4096))


def test_a_failure_in_the_engines_load_at_commit_is_dirty():
    engine = Recorder(fail_load=RuntimeError("engine refused the weights"))
    with receiving(StagedSink(engine), "tcp") as receiver, sending(receiver.address, raise_on_failure=False) as sender:
        report = sender.push({"a": torch.ones(64)}, 1)
        assert not report.ok and report.failed[0].kind == "SinkError"
        assert receiver.state == "dirty" and receiver.version is None
