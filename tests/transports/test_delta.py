"""Delta sync (`WeightSender(delta="all")`, patches over every transport): exact over many steps at
an RL learning rate, small on the wire, per receiver (a receiver not at the base gets the full
version in the same push), and never a silent mix when a patch is corrupted, applied to the wrong
base, or cut off; `delta=True` patches receivers on network transports only, by rule."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tests.helpers import assert_all_bit_exact, receiving, sending, wait_until
from tests.test_failures import Child
from tests.unit.test_wire import RawPeer
from weightsync import NegotiationError, TensorDictSink, WeightReceiver, WeightSender
from weightsync.delta import Baseline
from weightsync.landing import Landing
from weightsync.messages import Failed, Offer
from weightsync.patch import apply_patch
from weightsync.plan import build_plan, plan_id, wire_specs
from weightsync.sink import CallableSink
from weightsync.source import as_source

BUCKET = 1 << 16
"""Small buckets: patches and dense tensors both span several."""


class Trainer:
    """fp32 master weights N(0, 0.02) taking Adam steps on random gradients; pushed as bf16."""

    def __init__(self, lr: float = 1e-6, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        shapes = {"embed": (512, 256), "layer.w": (256, 384), "layer.b": (384,), "norm": (7,)}
        self.master = {name: torch.randn(shape, generator=self.gen) * 0.02 for name, shape in shapes.items()}
        self.step_count = torch.zeros(3, dtype=torch.int64)
        self.m = {name: torch.zeros_like(t) for name, t in self.master.items()}
        self.v = {name: torch.zeros_like(t) for name, t in self.master.items()}
        self.lr, self.t = lr, 0

    def step(self) -> None:
        self.t += 1
        for name, weight in self.master.items():
            grad = torch.randn(weight.shape, generator=self.gen)
            self.m[name].mul_(0.9).add_(grad, alpha=0.1)
            self.v[name].mul_(0.999).add_(grad * grad, alpha=0.001)
            m_hat, v_hat = self.m[name] / (1 - 0.9**self.t), self.v[name] / (1 - 0.999**self.t)
            weight.sub_(self.lr * m_hat / (v_hat.sqrt() + 1e-8))
        if self.t % 5 == 0:
            self.step_count += 1  # an int tensor that changes now and then, never cast

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.master, "step": self.step_count}

    def as_sent(self) -> dict[str, torch.Tensor]:
        return {name: t.to(torch.bfloat16) if t.is_floating_point() else t.clone() for name, t in self.state().items()}


def zeros_like_sent(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in trainer.as_sent().items()}


def changed_elements(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    bits = {2: torch.int16, 8: torch.int64}
    return sum(
        int((before[n].reshape(-1).view(bits[t.element_size()]) != t.reshape(-1).view(bits[t.element_size()])).sum())
        for n, t in after.items()
    )


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp", "collective"])
def test_twenty_steps_at_lr_1e6_are_bit_exact_and_small(transport: str) -> None:
    trainer = Trainer()
    dests = [zeros_like_sent(trainer), zeros_like_sent(trainer)]
    with (
        receiving(dests[0], transport) as first,
        receiving(dests[1], transport) as second,
        sending([first.address, second.address], cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender,
    ):
        before = trainer.as_sent()
        model_bytes = sum(t.numel() * t.element_size() for t in before.values())
        for version in range(21):
            if version:
                trainer.step()
            report = sender.push(trainer.state(), version)
            sent = trainer.as_sent()
            assert report.ok, report.failed
            for dest in dests:
                assert_all_bit_exact(dest, sent)
            assert first.content_digest == second.content_digest == report.content_digest != ""
            assert first.status.mode == second.status.mode == ("full" if version == 0 else "delta")
            modes = {outcome.mode for outcome in report.outcomes}
            if version == 0:
                assert modes == {"full"} and report.changed_fraction == 1.0
                assert report.outcomes[0].wire_bytes == model_bytes
            else:
                changed = changed_elements(before, sent)
                total = sum(t.numel() for t in sent.values())
                assert modes == {"delta"}
                assert math.isclose(report.changed_fraction, changed / total)
                assert 0 < changed / total < 0.2
                for outcome in report.outcomes:
                    # "blocks": a changed bf16 element costs 3 bytes, plus 2 bytes per 256 elements
                    assert outcome.wire_bytes <= 3 * changed + 0.01 * model_bytes, (outcome, changed)
                assert report.wire_bytes == report.outcomes[0].wire_bytes  # one plan, for both
            before = sent


def test_a_new_receiver_gets_the_full_version_in_the_same_push() -> None:
    trainer = Trainer(seed=1)
    old_dest, new_dest = zeros_like_sent(trainer), zeros_like_sent(trainer)
    with receiving(old_dest, "tcp") as old, receiving(zeros_like_sent(trainer), "tcp") as leaving:
        port = int(leaving.address.rsplit(":", 1)[1])
        with sending([old.address, leaving.address], cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender:
            assert sender.push(trainer.state(), 0).ok
            trainer.step()
            assert {o.mode for o in sender.push(trainer.state(), 1).outcomes} == {"delta"}
            leaving.close()  # restarted on the same address, empty
            with receiving(new_dest, "tcp", port=port) as new:
                assert new.address == leaving.address
                trainer.step()
                report = sender.push(trainer.state(), 2)
                assert report.ok, report.failed
                modes = {o.address: o.mode for o in report.outcomes}
                assert modes == {old.address: "delta", new.address: "full"}
                sizes = {o.address: o.wire_bytes for o in report.outcomes}
                assert sizes[old.address] < sizes[new.address] / 5
                assert report.wire_bytes == sum(sizes.values())
                assert old.content_digest == new.content_digest == report.content_digest
    assert_all_bit_exact(old_dest, trainer.as_sent())
    assert_all_bit_exact(new_dest, trainer.as_sent())


class FailsCommitOf(TensorDictSink):
    def __init__(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        super().__init__(tensors)
        self.failing = version

    def commit(self, version: int) -> None:
        if version == self.failing:
            raise RuntimeError("engine refused the version")
        super().commit(version)


@pytest.mark.fault(
    "a receiver at the wrong base version (delta)",
    expected="it gets the full version in the same push as the receivers at the base, which get the patch; both exact; a patch offered onto another base is refused",
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_receiver_at_the_wrong_base_gets_the_full_version(transport: str, observe) -> None:  # type: ignore[no-untyped-def]
    trainer = Trainer(seed=2)
    good_dest, lagging_dest = zeros_like_sent(trainer), zeros_like_sent(trainer)
    with (
        receiving(good_dest, transport) as good,
        receiving(FailsCommitOf(lagging_dest, 1), transport) as lagging,
        sending(
            [good.address, lagging.address],
            cast=torch.bfloat16,
            delta="all",
            bucket_bytes=BUCKET,
            raise_on_failure=False,
        ) as sender,
    ):
        assert sender.push(trainer.state(), 0).ok
        trainer.step()
        report = sender.push(trainer.state(), 1)
        assert [o.committed for o in report.outcomes] == [True, False]  # lagging still holds version 0
        trainer.step()
        report = sender.push(trainer.state(), 2)
        assert report.ok, report.failed
        assert [o.mode for o in report.outcomes] == ["delta", "full"]
        assert good.version == lagging.version == 2
        peer = RawPeer(lagging.address)
        try:
            peer.hello()
            peer.send(Offer(3, report_plan(trainer), plan_id(report_plan(trainer)), "bucket", delta_base="0" * 32))
            refused = peer.recv()
        finally:
            peer.close()
        assert isinstance(refused, Failed) and refused.kind == NegotiationError.__name__
        assert "patch onto content" in refused.message
        observe(
            "the receiver at version 0 got the full version 2 alongside a delta; a patch onto another base: NegotiationError"
        )
    assert_all_bit_exact(good_dest, trainer.as_sent())
    assert_all_bit_exact(lagging_dest, trainer.as_sent())


def report_plan(trainer: Trainer):  # type: ignore[no-untyped-def]
    source = as_source(trainer.state())
    return build_plan(wire_specs(source.metas(), torch.bfloat16), BUCKET)


@pytest.mark.fault(
    "a flipped byte in a patch (delta)",
    expected="ChecksumError naming version and bucket before the patch is applied; receiver not at the new version; its next push is full and exact",
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_flipped_byte_in_a_patch_fails_and_the_next_push_is_full(transport, monkeypatch, observe) -> None:  # type: ignore[no-untyped-def]
    original = Landing.finish_bucket

    def corrupted(self: Landing, index: int, checksum: int | None = None) -> None:
        piece = self.plan.buckets[index][0]
        if self.version == 2 and self.delta and self.plan.tensors[piece.tensor].encoding != "dense" and piece.nbytes:
            self.target(piece)[0] ^= 0x40
        original(self, index, checksum)

    monkeypatch.setattr(Landing, "finish_bucket", corrupted)
    trainer = Trainer(seed=3)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, transport) as receiver,
        sending(
            receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET, raise_on_failure=False
        ) as sender,
    ):
        for version in range(2):
            trainer.step()
            assert sender.push(trainer.state(), version).ok
        trainer.step()
        report = sender.push(trainer.state(), 2)
        (failure,) = report.failed
        assert failure.kind == "ChecksumError" and "of version 2" in failure.error and failure.mode == "delta"
        assert receiver.version != 2 and receiver.status.delta_base == ""
        after = (receiver.state, receiver.version)
        trainer.step()
        report = sender.push(trainer.state(), 3)
        assert report.ok and report.outcomes[0].mode == "full"
        observe(f"`{failure.kind}: {failure.error[:80]}`; receiver after: {after}; version 3 full and exact")
    assert_all_bit_exact(dest, trainer.as_sent())


def test_a_patch_onto_drifted_weights_fails_the_content_digest(observe) -> None:  # type: ignore[no-untyped-def]
    """The receiver's weights changed behind the sync's back: the patch applies, the digest of the
    full result differs from the sender's, the receiver is dirty, and the next push is full."""
    trainer = Trainer(seed=4)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, "tcp") as receiver,
        sending(
            receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET, raise_on_failure=False
        ) as sender,
    ):
        assert sender.push(trainer.state(), 0).ok
        dest["norm"][0] += 1  # drift
        trainer.step()
        report = sender.push(trainer.state(), 1)
        (failure,) = report.failed
        assert failure.kind == "ChecksumError" and "content digest" in failure.error
        assert (receiver.state, receiver.version) == ("dirty", None)
        trainer.step()
        report = sender.push(trainer.state(), 2)
        assert report.ok and report.outcomes[0].mode == "full"
    assert_all_bit_exact(dest, trainer.as_sent())


STALLING_SENDER = """
import sys, time, torch
import weightsync.transports.ring as ring, weightsync.transports.tcp as tcp
from weightsync import WeightSender
from tests.transports.test_delta import BUCKET, Trainer

trainer = Trainer(seed=5)
with WeightSender(sys.argv[1], cast=torch.bfloat16, delta="all", bucket_bytes=4096) as sender:
    for version in range(2):
        trainer.step()
        assert sender.push(trainer.state(), version).ok
    print("PUSHED", flush=True)
    for plane in (ring.RingSendPlane, tcp.SocketSendPlane):
        original = plane.send
        def stalling(self, index, *args, original=original):
            if index == 1:
                print("STALLED", flush=True)
                time.sleep(120)
            return original(self, index, *args)
        plane.send = stalling
    trainer.step()
    sender.push(trainer.state(), 2)
"""


@pytest.mark.slow
@pytest.mark.fault(
    "kill -9 of the sender mid-delta",
    expected="receiver notices, never claims the new version, holds no patch base once live bytes were patched; a new sender's push is full and exact",
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sender_killed_mid_delta(transport: str, observe) -> None:  # type: ignore[no-untyped-def]
    trainer = Trainer(seed=5)
    dest = zeros_like_sent(trainer)
    with receiving(dest, transport, timeout=60) as receiver, Child(STALLING_SENDER, receiver.address) as child:
        child.expect("PUSHED")
        assert receiver.version == 1 and receiver.status.delta_base != ""
        child.expect("STALLED")
        assert wait_until(lambda: receiver.state == "syncing")
        child.kill()
        killed = time.monotonic()
        assert wait_until(lambda: receiver.state != "syncing")
        noticed = time.monotonic() - killed
        assert receiver.version != 2 and "version 2" in receiver.last_error
        after = (receiver.state, receiver.version)
        if receiver.state == "dirty":
            assert receiver.status.delta_base == ""
        for _ in range(3):
            trainer.step()
        with sending(receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender:
            report = sender.push(trainer.state(), 3)
            assert report.ok and report.outcomes[0].mode == "full"
        observe(f"noticed in {noticed:.2f} s; receiver after: {after}; a new sender's version 3: full, exact")
    assert_all_bit_exact(dest, trainer.as_sent())


# --- the pieces, directly ---------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.05, 0.2, 0.99])
def test_patches_apply_bit_exact_with_the_cheapest_encoding(fraction: float) -> None:
    gen = torch.Generator().manual_seed(7)
    old = (torch.randn(4096, generator=gen) * 0.02).to(torch.bfloat16)
    new = old.clone()
    where = torch.randperm(4096, generator=gen)[: int(4096 * fraction)]
    new[where] = torch.randn(len(where), generator=gen).to(torch.bfloat16)
    new[where[:1]] = float("nan")  # compared by bits
    baseline = Baseline()
    specs = wire_specs(as_source({"w": old}).metas())
    baseline.diff(specs, as_source({"w": old}))
    diff = baseline.diff(specs, as_source({"w": new}))
    (spec,), (payload,) = diff.specs, diff.payloads
    expected = {0.0: "sparse", 0.001: "sparse", 0.05: "blocks", 0.2: "blocks", 0.99: "dense"}[fraction]
    assert spec.encoding == expected and diff.changed_elements == len(where)
    target = old.clone()
    if spec.encoding == "dense":
        target.copy_(payload)
    else:
        apply_patch(target, spec, payload)
    assert target.view(torch.int16).equal(new.view(torch.int16))
    assert diff.worth_it == (fraction < 0.5)


def test_a_patch_naming_elements_outside_its_tensor_is_refused() -> None:
    from weightsync.errors import PlanError
    from weightsync.messages import TensorSpec

    spec = TensorSpec("w", "bfloat16", (4,), "bfloat16", "sparse", 1)
    payload = torch.cat([torch.tensor([9], dtype=torch.int32).view(torch.uint8), torch.zeros(2, dtype=torch.uint8)])
    with pytest.raises(PlanError, match="outside"):
        apply_patch(torch.zeros(4, dtype=torch.bfloat16), spec, payload)


def test_a_loader_sink_always_gets_the_full_version() -> None:
    trainer = Trainer(seed=6)
    received: dict[str, torch.Tensor] = {}
    with (
        receiving(lambda items: received.update((n, t.clone()) for n, t in items), "tcp") as receiver,
        sending(receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender,
    ):
        for version in range(3):
            trainer.step()
            report = sender.push(trainer.state(), version)
            assert report.ok and report.outcomes[0].mode == "full"
            assert receiver.content_digest == report.content_digest and receiver.status.delta_base == ""
    assert_all_bit_exact(received, trainer.as_sent())


def test_a_staged_receiver_is_patched_in_its_standby_copy() -> None:
    from weightsync.sink import StagedSink

    trainer = Trainer(seed=7)
    live = zeros_like_sent(trainer)
    with (
        receiving(StagedSink(TensorDictSink(live)), "shm") as receiver,
        sending(receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender,
    ):
        for version in range(3):
            trainer.step()
            report = sender.push(trainer.state(), version)
            assert report.ok and report.outcomes[0].mode == ("full" if version == 0 else "delta")
            assert_all_bit_exact(live, trainer.as_sent())
    assert isinstance(receiver, WeightReceiver)


@pytest.mark.parametrize("whole", [False, True])
def test_a_staged_engine_gets_what_a_patch_changed_or_with_whole_every_tensor(whole: bool) -> None:
    from weightsync.sink import StagedSink

    weights = {"a": torch.zeros(64), "b": torch.ones(64), "c": torch.full((64,), 2.0)}
    fed: list[list[str]] = []
    held: dict[str, torch.Tensor] = {}

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        fed[-1].extend(name for name, _ in batch)
        held.update((name, tensor.clone()) for name, tensor in batch)

    with (
        receiving(StagedSink(CallableSink(load), whole=whole), "shm") as receiver,
        sending(receiver.address, delta="all", bucket_bytes=BUCKET) as sender,
    ):
        for version in range(3):
            fed.append([])
            weights = dict(weights, b=weights["b"].clone().index_fill_(0, torch.tensor([version]), -1.0))
            report = sender.push(weights, version)
            assert report.ok and report.outcomes[0].mode == ("full" if version == 0 else "delta")
            assert_all_bit_exact(held, weights)
    assert fed == [["a", "b", "c"], ["a", "b", "c"] if whole else ["b"], ["a", "b", "c"] if whole else ["b"]]


# --- who gets a patch is declared: network receivers (delta=True), or all ---------------------


def _push_steps(sender, dests, receivers, trainer, versions) -> list[list[str]]:
    """Push each version; every receiver exact; the modes each push's receivers got."""
    modes = []
    for version in versions:
        trainer.step()
        report = sender.push(trainer.state(), version)
        assert report.ok, report.failed
        for dest, receiver in zip(dests, receivers, strict=True):
            assert_all_bit_exact(dest, trainer.as_sent())
            assert receiver.version == version
        modes.append([outcome.mode for outcome in report.outcomes])
    return modes


def test_delta_true_patches_receivers_over_the_network_and_sends_shared_memory_ones_the_full_version() -> None:
    trainer = Trainer(seed=8)
    over_tcp, over_shm = zeros_like_sent(trainer), zeros_like_sent(trainer)
    with (
        receiving(over_tcp, "tcp") as tcp,
        receiving(over_shm, "shm") as shm,
        sending([tcp.address, shm.address], cast=torch.bfloat16, delta=True, bucket_bytes=BUCKET) as sender,
    ):
        modes = _push_steps(sender, [over_tcp, over_shm], [tcp, shm], trainer, range(4))
        # 0: nobody holds a base: a refresh, full to both; then tcp's patch, shm's full version
        assert modes == [["full", "full"]] + [["delta", "full"]] * 3


def test_delta_true_over_shared_memory_alone_pushes_as_without_delta() -> None:
    trainer = Trainer(seed=10)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, "shm") as receiver,
        sending(receiver.address, cast=torch.bfloat16, delta=True, bucket_bytes=BUCKET) as sender,
    ):
        assert _push_steps(sender, [dest], [receiver], trainer, range(3)) == [["full"]] * 3
        trainer.step()
        report = sender.push(trainer.state(), 3)
        assert report.ok and report.changed_fraction == 1.0
        assert report.content_digest == "", "no baseline, no verification: the push a sender without delta makes"


def test_delta_all_patches_receivers_over_every_transport() -> None:
    trainer = Trainer(seed=11)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, "shm") as receiver,
        sending(receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender,
    ):
        assert _push_steps(sender, [dest], [receiver], trainer, range(3)) == [["full"], ["delta"], ["delta"]]


@pytest.mark.parametrize("delta", ["always", "network", 1, None])
def test_a_delta_that_is_no_rule_is_refused(delta: object) -> None:
    from weightsync import ConfigError, SenderOptions

    with pytest.raises(ConfigError, match="delta must be True, False or 'all'"):
        SenderOptions(delta=delta)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_delta_over_cudaipc_patches_gpu_destinations_bit_exact() -> None:
    """cudaipc: the sender in a child process on the same GPU, destinations on the GPU; patches
    are staged in host memory and applied on the device."""
    from tests.peer_process import SenderProcess

    trainer = Trainer(seed=9)
    dest = {name: t.to("cuda") for name, t in zeros_like_sent(trainer).items()}
    with (
        SenderProcess("cuda") as process,
        receiving(dest, "cudaipc") as receiver,
        process.sending(receiver.address, cast=torch.bfloat16, delta="all", bucket_bytes=BUCKET) as sender,
    ):
        for version in range(4):
            if version:
                trainer.step()
            report = sender.push(trainer.state(), version)
            assert report.ok, report.failed
            assert report.outcomes[0].mode == ("full" if version == 0 else "delta")
            assert_all_bit_exact({name: t.cpu() for name, t in dest.items()}, trainer.as_sent())
            assert receiver.content_digest == report.content_digest != ""


def test_delta_true_to_a_receiver_it_does_not_patch_says_why_once(monkeypatch, caplog) -> None:
    """delta=True diffs only over network transports: to an in-process (or shared-memory) receiver
    every push goes whole, and the sender says so, one line, once per transport."""
    import logging

    import weightsync.deliveries

    monkeypatch.setattr(weightsync.deliveries, "_SAID", set())
    weights = {"w": torch.zeros(64)}
    with caplog.at_level(logging.WARNING, logger="weightsync.deliveries"):
        for version in (1, 2):  # two senders, as a server group rebuilds its own
            with WeightReceiver({"w": torch.zeros(64)}, transport="inproc").start() as receiver:
                with WeightSender([receiver.address], delta=True) as sender:
                    report = sender.push(weights, version)
            assert [o.mode for o in report.outcomes] == ["full"]
    said = [r.getMessage() for r in caplog.records if "delta=True" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("delta=True sends every push whole to inproc receivers"), said
