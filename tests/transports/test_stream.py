"""StreamSink: a sync pulled as (name, tensor) pairs on the consumer's thread, over every
transport. Tensors arrive bucket by bucket, bit-exact; the version commits only after the
consumer took every tensor; a consumer that stops early, never comes, or is too slow aborts the
sync on this receiver (the sender reports it); a sync that fails raises on the consumer's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.helpers import assert_all_bit_exact, random_tensor, receiving, sending
from weightsync import (
    Adapter,
    ConfigError,
    NegotiationError,
    PlanError,
    RemoteError,
    SinkError,
    TransferTimeout,
    WeightSyncError,
)
from weightsync.source import TensorMeta
from weightsync.stream import StreamSink

MODEL = {
    "embed": random_tensor(torch.bfloat16, (512, 64), seed=1),  # 64 KiB: larger than the bucket
    "norm": random_tensor(torch.float32, (64,), seed=2),
    "proj": random_tensor(torch.float16, (64, 32), seed=3),
    "head": random_tensor(torch.int8, (100,), seed=4),
}
BUCKET = 16 << 10


class Pusher:
    """A push on a thread of its own, as a trainer in another process would run it."""

    def __init__(self, push: Callable[[], object]) -> None:
        self.result: object = None
        self.thread = threading.Thread(target=self._run, args=(push,), daemon=True)
        self.thread.start()

    def _run(self, push: Callable[[], object]) -> None:
        try:
            self.result = push()
        except BaseException as exc:
            self.result = exc

    def join(self) -> object:
        self.thread.join(30)
        assert not self.thread.is_alive(), "push did not return"
        return self.result


def test_stream_yields_every_tensor_bit_exact_and_commits_after_the_last(transport):
    sink = StreamSink(timeout=10)
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        for version in (1, 2):
            pusher = Pusher(lambda v=version: sender.push(MODEL, version=v))  # type: ignore[misc]
            got = {}
            with sink.stream(version=version) as tensors:
                for name, tensor in tensors:
                    assert receiver.version == (None if version == 1 else version - 1), "committed early"
                    got[name] = tensor.clone()
                assert tensors.committed_version == version
            report = pusher.join()
            assert report.ok, report  # type: ignore[attr-defined]
            assert list(got) == list(MODEL), "plan order"
            assert_all_bit_exact(got, MODEL)
            assert receiver.wait_for_version(version, timeout=10)
            assert receiver.state == "ready"


def test_batches_hand_over_a_bucket_at_a_time_and_commit_after_the_last(transport):
    sink = StreamSink(timeout=10)
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        pusher = Pusher(lambda: sender.push(MODEL, version=5))
        got: dict[str, torch.Tensor] = {}
        with sink.stream(version=5) as stream:
            for batch in stream.batches():
                assert receiver.version is None, "committed early"
                got |= {name: tensor.clone() for name, tensor in batch}
                sizes = [tensor.nbytes for _, tensor in batch]
                assert len(batch) == 1 or sum(sizes) <= BUCKET, f"a batch is one bucket, got {sizes}"
            assert stream.committed_version == 5
        assert pusher.join().ok  # type: ignore[attr-defined]
        assert list(got) == list(MODEL)
        assert_all_bit_exact(got, MODEL)
        assert receiver.wait_for_version(5, timeout=10)


def test_consumer_that_stops_early_aborts_the_sync(transport):
    sink = StreamSink(timeout=10)
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, raise_on_failure=False) as sender,
    ):
        pusher = Pusher(lambda: sender.push(MODEL, version=3))
        for _name, _tensor in sink.stream(version=3):
            break  # the stream is dropped here: the sync is abandoned at once
        report = pusher.join()
        assert not report.ok  # type: ignore[attr-defined]
        assert "the consumer stopped after 1 tensors" in report.failed[0].error  # type: ignore[attr-defined]
        assert receiver.version is None and receiver.state == "dirty"
        # the next sync, fully taken, commits
        pusher = Pusher(lambda: sender.push(MODEL, version=4))
        got = {name: tensor.clone() for name, tensor in sink.stream(version=4)}
        assert pusher.join().ok  # type: ignore[attr-defined]
        assert_all_bit_exact(got, MODEL)


def test_no_consumer_times_out_the_sync_and_the_late_consumer_hears_why():
    sink = StreamSink(timeout=0.5)
    with (
        receiving(sink, "shm") as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, timeout=10, raise_on_failure=False) as sender,
    ):
        report = sender.push(MODEL, version=5)
        assert not report.ok and "no consumer took a bucket" in report.failed[0].error
        with pytest.raises(TransferTimeout, match="no consumer took a bucket"):
            next(sink.stream(version=5))
        assert receiver.version is None


def test_sender_that_dies_mid_sync_raises_on_the_consumer_thread():
    sink = StreamSink(timeout=10)
    with receiving(sink, "tcp", timeout=1.0) as receiver:
        sender = sending(receiver.address, bucket_bytes=BUCKET, timeout=10)

        def source():  # type: ignore[no-untyped-def]
            yield "embed", MODEL["embed"]
            raise RuntimeError("trainer crashed")

        from weightsync import StateDictSource

        class Crashing(StateDictSource):
            def tensors(self):  # type: ignore[no-untyped-def]
                return source()

        with sender as live:
            pusher = Pusher(lambda: live.push(Crashing(list(MODEL.items())), version=6))
            with pytest.raises(WeightSyncError, match="sender failed: trainer crashed"):
                for _ in sink.stream(version=6):
                    pass
            assert isinstance(pusher.join(), RuntimeError)
        assert receiver.version is None


def test_stream_waits_a_bounded_time_for_a_sync_and_checks_the_version():
    sink = StreamSink(timeout=0.2)
    with pytest.raises(TransferTimeout, match="no sync of version 1 began"):
        next(sink.stream(version=1))
    with pytest.raises(ConfigError):
        sink.stream(version=-1)
    with pytest.raises(ConfigError):
        StreamSink(timeout=0)
    sink = StreamSink(timeout=10)
    with (
        receiving(sink, "shm") as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, raise_on_failure=False) as sender,
    ):
        pusher = Pusher(lambda: sender.push(MODEL, version=7))
        with pytest.raises(PlanError, match="version 7, expected 8"):
            next(sink.stream(version=8))
        report = pusher.join()
        assert not report.ok and "expected version 8" in report.failed[0].error  # type: ignore[attr-defined]


def test_close_from_another_thread_wakes_the_consumer():
    sink = StreamSink(timeout=10)
    stream = sink.stream()
    timer = threading.Timer(0.2, stream.close)
    timer.start()
    with pytest.raises(SinkError, match="closed"):
        next(stream)
    timer.join()
    with pytest.raises(StopIteration):
        next(stream)


class _Twice:
    """A trainer's source that names one tensor twice: a plan the receiver refuses."""

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta("norm", (64,), torch.float32)] * 2

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter([("norm", MODEL["norm"])] * 2)


def test_a_stream_for_a_refused_offer_raises_the_refusal_not_a_timeout(transport):
    sink = StreamSink(timeout=30)  # a long timeout: the refusal, not the wait, must end the stream
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, raise_on_failure=False) as sender,
    ):
        report = sender.push(_Twice(), version=3)  # refused before the consumer asks for it
        assert not report.ok and "twice" in report.failed[0].error
        started = time.monotonic()
        with pytest.raises(PlanError, match="twice"):
            next(sink.stream(version=3))
        assert time.monotonic() - started < 10, "the consumer waited out its timeout"
        assert receiver.version is None and receiver.state == "empty"
        # the next sync, of any version, is taken as usual
        pusher = Pusher(lambda: sender.push(MODEL, version=4))
        got = {name: tensor.clone() for name, tensor in sink.stream(version=4)}
        assert pusher.join().ok  # type: ignore[attr-defined]
        assert_all_bit_exact(got, MODEL)


def test_a_stream_waiting_while_the_receiver_is_busy_hears_the_refusal(transport):
    sink = StreamSink(timeout=30)
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET) as first,
        sending(receiver.address, bucket_bytes=BUCKET, raise_on_failure=False) as second,
    ):
        pusher = Pusher(lambda: first.push(MODEL, version=1))
        holding = sink.stream(version=1)
        name, tensor = next(holding)  # the consumer holds version 1's first bucket: the receiver is busy
        got = {name: tensor.clone()}
        waiter = Pusher(lambda: next(sink.stream(version=2)))  # a consumer already waiting for version 2
        started = time.monotonic()
        report = second.push(MODEL, version=2)
        assert not report.ok and report.failed[0].kind == "NegotiationError", report
        assert isinstance(waiter.join(), NegotiationError)
        assert time.monotonic() - started < 10, "the waiting consumer waited out its timeout"
        got |= {name: tensor.clone() for name, tensor in holding}
        assert pusher.join().ok  # type: ignore[attr-defined]
        assert_all_bit_exact(got, MODEL)
        assert receiver.version == 1


class _Unreadable:
    """A trainer's source that fails before a push can plan anything (its metadata raises)."""

    def metas(self) -> list[TensorMeta]:
        raise ValueError("the checkpoint's index is unreadable")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("never walked")


@pytest.mark.parametrize("why", ["the source fails", "the bucket size"])
def test_a_stream_hears_at_once_when_the_sender_gives_up_before_its_offer(transport, why):
    """A push that fails before it offers anything (its source, a bucket size the receiver
    cannot afford) tells the receiver, so the consumer waiting for that version stops waiting."""
    sink = StreamSink(timeout=30)  # a long timeout: the sender's word, not the wait, must end the stream
    limits = {"max_bucket_bytes": BUCKET} if why == "the bucket size" else {}
    demands = {"min_bucket_bytes": 4 * BUCKET} if why == "the bucket size" else {}
    with (
        receiving(sink, transport, **limits) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, raise_on_failure=False, **demands) as sender,
    ):
        assert sender.connect() == {}  # connected: the receiver waits for an offer
        waiter = Pusher(lambda: next(sink.stream(version=3)))
        started = time.monotonic()
        if why == "the source fails":
            with pytest.raises(ValueError, match="unreadable"):
                sender.push(_Unreadable(), version=3)
        else:
            report = sender.push(MODEL, version=3)
            assert not report.ok and report.failed[0].kind == "NegotiationError", report
        heard = waiter.join()
        assert isinstance(heard, RemoteError), heard
        assert "gave up on version 3" in str(heard)
        assert ("unreadable" if why == "the source fails" else "at most") in str(heard)
        assert time.monotonic() - started < 10, "the consumer waited out its timeout"
        assert receiver.version is None and receiver.state == "empty" and "gave up" in receiver.last_error
        if why == "the source fails":  # the same sender's next push is taken as usual
            pusher = Pusher(lambda: sender.push(MODEL, version=4))
            got = {name: tensor.clone() for name, tensor in sink.stream(version=4)}
            assert pusher.join().ok  # type: ignore[attr-defined]
            assert_all_bit_exact(got, MODEL)


def test_an_adapter_push_given_up_before_its_offer_is_not_the_base_weights_refusal(transport):
    """The base weights' sink hears nothing of an adapter's version the sender gave up on: a
    consumer waiting for the base weights' version of the same number is not the one refused."""
    heard: list[int] = []

    class Recording(StreamSink):
        def refused(self, version: int, error: BaseException) -> None:
            heard.append(version)
            super().refused(version, error)

    adapter = Adapter("math", rank=2, alpha=4.0, target_modules=("q_proj",))
    with (
        receiving(Recording(timeout=30), transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, raise_on_failure=False) as sender,
    ):
        assert sender.connect() == {}
        with pytest.raises(ValueError, match="unreadable"):
            sender.push(_Unreadable(), version=3, adapter=adapter)
        deadline = time.monotonic() + 10
        while "gave up" not in receiver.last_error and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "adapter 'math' version 3" in receiver.last_error and heard == []
        assert receiver.state == "empty"
