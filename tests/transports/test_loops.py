"""The two loops and what they return: a push's deadline, the receiver's one status value, the
sink told whether the served weights are intact, options given once, versions that only go
forward unless the sender allows an older one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from tests.helpers import receiving, sending
from weightsync import (
    ConfigError,
    ReceiverOptions,
    SenderOptions,
    SinkTraits,
    SyncFailed,
    TensorMeta,
    TransferTimeout,
    WeightSink,
)

TRANSPORTS = ["inproc", "shm", "tcp"]


class SlowSource:
    """Yields its tensors `delay_s` apart, as a trainer gathering shards would."""

    def __init__(self, tensors: dict[str, torch.Tensor], delay_s: float) -> None:
        self._tensors, self._delay_s = tensors, delay_s

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self._tensors.items()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._tensors.items():
            time.sleep(self._delay_s)
            yield name, tensor


class Verdicts(WeightSink):
    """Records what each abort was told."""

    def __init__(self, dest: dict[str, torch.Tensor], *, live: bool) -> None:
        self.dest, self.traits, self.verdicts = dest, SinkTraits(live_destinations=live), []

    def destination(self, name: str) -> torch.Tensor | None:
        return self.dest[name]

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        self.verdicts.append((version, intact))


def weights(value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256,), float(value)) for i in range(4)}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_push_past_its_deadline_aborts_everywhere_and_the_next_one_commits(transport: str) -> None:
    dest = {name: torch.zeros(256) for name in weights(0)}
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=1024) as sender:
        assert sender.push(weights(1), version=1).ok
        with pytest.raises(TransferTimeout, match="deadline"):
            sender.push(SlowSource(weights(2), delay_s=0.2), version=2, deadline=0.3)
        assert receiver.version in (1, None) and receiver.state in ("ready", "dirty")
        assert sender.push(weights(3), version=3).ok
        assert receiver.status.version == 3 and receiver.status.state == "ready"
        assert all(torch.equal(tensor, torch.full((256,), 3.0)) for tensor in dest.values())


@pytest.mark.parametrize("deadline", [0, -1.0, True, "1"])
def test_a_bad_deadline_is_refused_before_anything_moves(deadline: object) -> None:
    with receiving({}, "inproc") as receiver, sending(receiver.address) as sender:
        with pytest.raises(ConfigError, match="deadline"):
            sender.push({}, version=1, deadline=deadline)  # type: ignore[arg-type]
        assert receiver.state == "empty"


@pytest.mark.parametrize("live", [True, False], ids=["live-destinations", "standby-destinations"])
def test_the_sink_is_told_whether_the_served_weights_are_intact(live: bool) -> None:
    sink = Verdicts({name: torch.zeros(256) for name in weights(0)}, live=live)
    with receiving(sink, "shm") as receiver, sending(receiver.address, bucket_bytes=1024) as sender:
        assert sender.push(weights(1), version=1).ok
        with pytest.raises(TransferTimeout):  # bucket 0 goes at about 1 s, bucket 1 is past the deadline
            sender.push(SlowSource(weights(2), delay_s=1.0), version=2, deadline=1.5)
        # the sender's abort reaches the receiver after some buckets landed in the destinations
        assert sink.verdicts == [(2, not live)]
        assert receiver.state == ("dirty" if live else "ready")
        assert receiver.version == (None if live else 1)


def test_the_status_is_one_value_replaced_whole() -> None:
    with receiving({"w": torch.zeros(4)}, "inproc") as receiver, sending(receiver.address) as sender:
        before = receiver.status
        assert sender.push({"w": torch.ones(4)}, version=7).ok
        after = receiver.status
        assert (before.state, before.version) == ("empty", None)
        assert (after.state, after.version, after.last_error) == ("ready", 7, "")
        with pytest.raises(AttributeError):
            after.version = 8  # type: ignore[misc]


def test_options_are_given_once_as_values_or_as_keywords() -> None:
    options = SenderOptions(timeout=5, verify="bucket")
    assert options.timeout == 5.0 and options.verify == "bucket"
    with pytest.raises(ConfigError, match="not both"):
        sending("inproc://x", options=options, timeout=3).__enter__()
    with pytest.raises(ConfigError, match="unknown option"):
        sending("inproc://x", bucket_size=4096).__enter__()
    with pytest.raises(ConfigError, match="timeout must be a positive"):
        ReceiverOptions(timeout=0)
    with pytest.raises(ConfigError, match="verify must be one of"):
        SenderOptions(verify="sometimes")  # type: ignore[arg-type]
    with receiving({}, "inproc", options=None, verify="full") as receiver:
        assert receiver.options == ReceiverOptions(timeout=10.0, verify="full")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_receiver_reports_where_its_sync_went(transport: str) -> None:
    def slow_loader(named: list[tuple[str, torch.Tensor]]) -> None:
        time.sleep(0.05)
        if any(name == "refused" for name, _ in named):
            raise ValueError("the engine refuses this one")

    with (
        receiving(slow_loader, transport) as receiver,
        sending(receiver.address, bucket_bytes=1024, raise_on_failure=False) as sender,
    ):
        report = sender.push(weights(1), version=1)
        (outcome,) = report.outcomes
        times = outcome.times
        assert outcome.committed and times is not None and times == receiver.status.times
        assert times.load_s >= 4 * 0.05, "four buckets, each loaded by a sink that takes 50 ms"
        parts = times.transfer_s + times.landing_s + times.load_s + times.pause_s
        assert parts == pytest.approx(times.total_s, abs=1e-6) and times.total_s <= report.seconds
        failed = sender.push({"refused": torch.zeros(3)}, version=2)
        assert not failed.ok and failed.outcomes[0].times is None


class FailingSource(SlowSource):
    """Yields its first three tensors, then raises: the push fails after bucket 0 landed."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from list(self._tensors.items())[:3]
        raise RuntimeError("the trainer's source broke")


def test_a_version_at_or_below_the_last_committed_is_refused_also_while_dirty() -> None:
    dest = {name: torch.zeros(256) for name in weights(0)}
    with receiving(dest, "shm") as receiver, sending(receiver.address, bucket_bytes=1024) as sender:
        assert sender.push(weights(5), version=5).ok
        with pytest.raises(SyncFailed, match="versions only go forward"):
            sender.push(weights(6), version=5)  # the same version, other content
        with pytest.raises(RuntimeError, match="broke"):
            sender.push(FailingSource(weights(6), 0), version=6)
        assert (receiver.state, receiver.version, receiver.status.last_committed) == ("dirty", None, 5)
        held = {name: tensor.clone() for name, tensor in dest.items()}
        for older in (1, 5):
            with pytest.raises(SyncFailed, match=f"version {older} is not above version 5, committed here last"):
                sender.push(weights(older), version=older)
        assert all(torch.equal(dest[name], held[name]) for name in dest)  # nothing of a refused push lands
        assert (receiver.state, receiver.status.last_committed) == ("dirty", 5)
        assert sender.push(weights(6), version=6).ok
        assert (receiver.state, receiver.version, receiver.status.last_committed) == ("ready", 6, 6)


def test_allow_older_version_moves_a_receiver_back() -> None:
    dest = {name: torch.zeros(256) for name in weights(0)}
    with receiving(dest, "tcp") as receiver:
        with sending(receiver.address) as sender:
            assert sender.push(weights(5), version=5).ok
        with sending(receiver.address, allow_older_version=True) as sender:
            assert sender.push(weights(2), version=2).ok
        assert (receiver.version, receiver.status.last_committed) == (2, 2)
        assert all(torch.equal(tensor, torch.full((256,), 2.0)) for tensor in dest.values())
        with sending(receiver.address) as sender:  # from there on, forward again from 2
            assert sender.push(weights(3), version=3).ok
