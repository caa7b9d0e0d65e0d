"""verify="bucket": every bucket checksummed by the sender and checked where it landed; a
flipped byte fails the sync with a ChecksumError naming version and bucket, and the next push
goes through.

cudaipc takes the flipped byte too, on a GPU host (marked `gpu`): the sender checksums what it
packed into its GPU ring, the receiver what landed (device to host here). Its pushes come from a
child process (`tests.peer_process.sending`), as CUDA IPC does not open a handle in the process
that exported it; the receiver, and the byte flipped in it, stay in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import assert_all_bit_exact, random_tensor, receiving
from tests.peer_process import sending
from tests.unit.test_wire import RawPeer
from weightsync import ConfigError, NegotiationError, WeightReceiver
from weightsync.landing import Landing
from weightsync.messages import Failed, Offer, TensorSpec
from weightsync.plan import build_plan, plan_id

BUCKET = 4096


def model() -> dict[str, torch.Tensor]:
    return {
        "big": random_tensor(torch.bfloat16, (5 * BUCKET // 2 + 3,), seed=1),  # chunked over 3+ buckets
        "small": random_tensor(torch.float32, (33,), seed=2),
        "flag": random_tensor(torch.bool, (7,), seed=3),
    }


def zeros(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in named.items()}


@pytest.fixture
def flip_bucket_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Corrupt one landed byte of bucket 1 of version 1, before the checksum is checked (bytes
    lent from a read-only transport buffer are swapped for a corrupted copy)."""
    original = Landing.finish_bucket

    def corrupted(self: Landing, index: int, checksum: int | None = None) -> None:
        if self.version == 1 and index == 1:
            piece = self.plan.buckets[1][0]
            lent = self._lent.get(piece.tensor)
            if lent is None:
                self.target(piece)[0] ^= 0x40
            else:  # host bytes, or a GPU buffer's (cudaipc)
                flipped = lent.clone() if isinstance(lent, torch.Tensor) else np.array(lent, copy=True)
                flipped[piece.tensor_offset] ^= 0x40
                self._lent[piece.tensor] = flipped
        original(self, index, checksum)

    monkeypatch.setattr(Landing, "finish_bucket", corrupted)


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_verified_round_trip(transport: str) -> None:
    source = model()
    dest = zeros(source)
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET, verify="bucket") as s:
        assert s.push(source, 1).ok
    assert_all_bit_exact(dest, source)


@pytest.mark.fault(
    "a bucket with a flipped byte (verify=bucket)",
    expected="ChecksumError naming version and bucket before the bucket reaches the sink; `dirty` if it landed in live tensors, else the previous version serves; next push commits",
)
@pytest.mark.parametrize("transport", ["shm", "tcp", pytest.param("cudaipc", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("where", ["in-place", "staged"])
def test_a_flipped_byte_fails_the_sync_and_the_next_push_succeeds(transport, where, flip_bucket_1, observe) -> None:
    source = model()
    dest = zeros(source)
    received: dict[str, torch.Tensor] = {}
    sink = dest if where == "in-place" else (lambda items: received.update((n, t.clone()) for n, t in items))
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, verify="bucket", raise_on_failure=False) as s,
    ):
        assert s.push(source, 0).ok  # version 0 lands intact (only version 1 is corrupted)
        report = s.push(source, 1)
        assert not report.ok
        failure = report.failed[0]
        assert failure.kind == "ChecksumError" and "bucket 1 of version 1" in failure.error, failure
        assert "bucket 1 of version 1" in receiver.last_error
        if where == "in-place":  # live weights were partly overwritten: explicitly not ready
            assert receiver.state == "dirty"
        else:  # nothing reached the sink's live weights: still serving version 0
            assert (receiver.state, receiver.version) == ("ready", 0)
        after = (receiver.state, receiver.version)
        assert s.push(source, 2).ok
        assert (receiver.state, receiver.version) == ("ready", 2)
        observe(
            f"`{failure.kind}: {failure.error[:90]}`; receiver after: {after[0]}, version {after[1]}; version 2 committed"
        )
    assert_all_bit_exact(dest if where == "in-place" else received, source)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_receiver_that_requires_verification_gets_it(transport, flip_bucket_1) -> None:
    source = model()
    with (
        receiving(zeros(source), transport, verify="bucket") as receiver,
        sending(
            receiver.address, bucket_bytes=BUCKET, raise_on_failure=False
        ) as sender,  # the sender's own default: off
    ):
        report = sender.push(source, 1)
        assert report.failed and report.failed[0].kind == "ChecksumError"


def test_without_verification_the_flip_goes_unnoticed(flip_bucket_1) -> None:
    """What verification is for: the same corruption, unverified, commits."""
    source = model()
    dest = zeros(source)
    with receiving(dest, "shm") as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        assert sender.push(source, 1).ok
    assert any(not torch.equal(dest[name], source[name]) for name in source)


def test_bad_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match="verify must be one of"):
        WeightReceiver({}, "inproc", verify="everything").start()
    with pytest.raises(ConfigError, match="verify must be one of"):
        sending("inproc://x", verify=True).__enter__()


def test_an_offer_weaker_than_the_receiver_requires_is_refused() -> None:
    plan = build_plan([TensorSpec("w", "float32", (4,), "float32")], 64)
    with receiving({"w": torch.zeros(4)}, "tcp", verify="bucket") as receiver:
        peer = RawPeer(receiver.address)  # a real sender never offers less than the Welcome asks
        try:
            peer.hello()
            peer.send(Offer(1, plan, plan_id(plan), "off"))
            refused = peer.recv()
        finally:
            peer.close()
        assert isinstance(refused, Failed) and refused.kind == NegotiationError.__name__
        assert "requires verify='bucket'" in refused.message
        assert receiver.state == "empty"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_content_digest_is_what_both_sides_agree_they_moved(transport: str) -> None:
    source = model()
    with receiving(zeros(source), transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        unverified = sender.push(source, 1)
        assert unverified.ok and unverified.content_digest == "" and receiver.content_digest == ""
    with (
        receiving(zeros(source), transport) as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, verify="bucket") as sender,
    ):
        first = sender.push(source, 1)
        assert first.ok and len(first.content_digest) == 32
        assert receiver.content_digest == first.content_digest
        changed = dict(source, small=source["small"] + 1)
        second = sender.push(changed, 2)
        assert receiver.content_digest == second.content_digest != first.content_digest
        assert sender.push(source, 3).content_digest == first.content_digest  # same bytes, same digest


def test_a_content_digest_that_differs_fails_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    import weightsync.sender
    from weightsync.checksum import SyncHashes

    class WrongDigest(SyncHashes):
        def content_digest(self) -> str:
            return "0" * 32

    monkeypatch.setattr(weightsync.sender, "SyncHashes", WrongDigest)  # the sender's side only
    source = model()
    with (
        receiving(zeros(source), "shm") as receiver,
        sending(receiver.address, bucket_bytes=BUCKET, verify="bucket", raise_on_failure=False) as sender,
    ):
        report = sender.push(source, 1)
        assert report.failed[0].kind == "ChecksumError" and "content digest" in report.failed[0].error
        assert receiver.state == "dirty" and receiver.content_digest == ""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("where", ["in-place", "non-contiguous", "staged"])
def test_full_verification_round_trips(transport: str, where: str) -> None:
    source = model()
    received: dict[str, torch.Tensor] = {}
    if where == "staged":
        sink = lambda items: received.update((n, t.clone()) for n, t in items)  # noqa: E731
    else:
        sink = zeros(source)
        if where == "non-contiguous":  # staged in a fresh tensor, then copied into the destination
            sink["big"] = torch.zeros(2 * source["big"].numel(), dtype=torch.bfloat16)[::2]
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET, verify="full") as s:
        report = s.push(source, 1)
        assert report.ok, report.failed
        assert receiver.content_digest == report.content_digest
    assert_all_bit_exact(received if where == "staged" else sink, source)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_full_verification_catches_bytes_in_the_wrong_place(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug after the bucket check (a destination written wrongly) passes verify="bucket" but
    not "full", which hashes every tensor where it finally sits."""
    original = Landing.finish_bucket

    def misplaced(self: Landing, index: int, checksum: int | None = None) -> None:
        original(self, index, checksum)
        if index == 0:
            self.target(self.plan.buckets[0][0])[:2] = 0x7F  # after the check passed

    monkeypatch.setattr(Landing, "finish_bucket", misplaced)
    source = model()
    for verify, caught in (("bucket", False), ("full", True)):
        with (
            receiving(zeros(source), transport) as receiver,
            sending(receiver.address, bucket_bytes=BUCKET, verify=verify, raise_on_failure=False) as sender,
        ):
            report = sender.push(source, 1)
            assert report.ok is not caught, (verify, report.failed)
            if caught:
                assert report.failed[0].kind == "ChecksumError" and "'big'" in report.failed[0].error
                assert receiver.state == "dirty"
