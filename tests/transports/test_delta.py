"""Delta sync (`WeightSender(delta=True, delta_policy="always")`): exact over many steps at an RL learning rate, small on
the wire, per receiver (a receiver not at the base gets the full version in the same push), and
never a silent mix when a patch is corrupted, applied to the wrong base, or cut off."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tests.helpers import assert_all_bit_exact, receiving, sending, wait_until
from tests.test_failures import Child
from weightsync import NegotiationError, TensorDictSink, WeightReceiver
from weightsync.delta import Baseline, apply_patch
from weightsync.landing import Landing
from weightsync.plan import build_plan, plan_digest, wire_specs
from weightsync.source import as_source
from weightsync.types import Offer

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
        sending(
            [first.address, second.address], cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender,
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
                    assert outcome.wire_bytes <= 6 * changed + 0.01 * model_bytes, (outcome, changed)
                assert report.wire_bytes == report.outcomes[0].wire_bytes  # one plan, for both
            before = sent


def test_a_new_receiver_gets_the_full_version_in_the_same_push() -> None:
    trainer = Trainer(seed=1)
    old_dest, new_dest = zeros_like_sent(trainer), zeros_like_sent(trainer)
    with receiving(old_dest, "tcp") as old, receiving(zeros_like_sent(trainer), "tcp") as leaving:
        port = int(leaving.address.rsplit(":", 1)[1])
        with sending(
            [old.address, leaving.address], cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender:
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
            [good.address, lagging.address], cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
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
        with pytest.raises(NegotiationError, match="patch onto content"):
            lagging.begin(Offer(3, report_plan(trainer), plan_digest(report_plan(trainer)), "bucket", base="0" * 32))
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
            self.host_view(piece)[0] ^= 0x40
        original(self, index, checksum)

    monkeypatch.setattr(Landing, "finish_bucket", corrupted)
    trainer = Trainer(seed=3)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, transport) as receiver,
        sending(
            receiver.address, cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender,
    ):
        for version in range(2):
            trainer.step()
            assert sender.push(trainer.state(), version).ok
        trainer.step()
        report = sender.push(trainer.state(), 2)
        (failure,) = report.failed
        assert failure.kind == "ChecksumError" and "of version 2" in failure.error and failure.mode == "delta"
        assert receiver.version != 2 and receiver.welcome().content == ""
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
            receiver.address, cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
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
with WeightSender(sys.argv[1], cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=4096) as sender:
    for version in range(2):
        trainer.step()
        assert sender.push(trainer.state(), version).ok
    print("PUSHED", flush=True)
    for plane in (ring.RingSendPlane, tcp.StreamSendPlane):
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
        assert receiver.version == 1 and receiver.welcome().content != ""
        child.expect("STALLED")
        assert wait_until(lambda: receiver.state == "syncing")
        child.kill()
        killed = time.monotonic()
        assert wait_until(lambda: receiver.state != "syncing")
        noticed = time.monotonic() - killed
        assert receiver.version != 2 and "version 2" in receiver.last_error
        after = (receiver.state, receiver.version)
        if receiver.state == "dirty":
            assert receiver.welcome().content == ""
        for _ in range(3):
            trainer.step()
        with sending(
            receiver.address, cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender:
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
    expected = {0.0: "sparse", 0.001: "sparse", 0.05: "sparse", 0.2: "bitmap", 0.99: "dense"}[fraction]
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
    from weightsync.types import TensorSpec

    spec = TensorSpec("w", "bfloat16", (4,), "bfloat16", "sparse", 1)
    payload = torch.cat([torch.tensor([9], dtype=torch.int32).view(torch.uint8), torch.zeros(2, dtype=torch.uint8)])
    with pytest.raises(PlanError, match="outside"):
        apply_patch(torch.zeros(4, dtype=torch.bfloat16), spec, payload)


def test_a_loader_sink_always_gets_the_full_version() -> None:
    trainer = Trainer(seed=6)
    received: dict[str, torch.Tensor] = {}
    with (
        receiving(lambda items: received.update((n, t.clone()) for n, t in items), "tcp") as receiver,
        sending(
            receiver.address, cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender,
    ):
        for version in range(3):
            trainer.step()
            report = sender.push(trainer.state(), version)
            assert report.ok and report.outcomes[0].mode == "full"
            assert receiver.content_digest == report.content_digest and receiver.welcome().content == ""
    assert_all_bit_exact(received, trainer.as_sent())


def test_a_staged_receiver_is_patched_in_its_standby_copy() -> None:
    from weightsync.sink import StagedSink

    trainer = Trainer(seed=7)
    live = zeros_like_sent(trainer)
    with (
        receiving(StagedSink(TensorDictSink(live)), "shm") as receiver,
        sending(
            receiver.address, cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender,
    ):
        for version in range(3):
            trainer.step()
            report = sender.push(trainer.state(), version)
            assert report.ok and report.outcomes[0].mode == ("full" if version == 0 else "delta")
            assert_all_bit_exact(live, trainer.as_sent())
    assert isinstance(receiver, WeightReceiver)


# --- never slower than full: skip a diff that would not pay (delta.Costs) ------------------------


def test_a_diff_pays_only_when_it_and_the_patch_arrive_before_the_full_version() -> None:
    from weightsync.delta import Costs, Diff, Sample

    gib = 1 << 30
    costs = Costs()
    assert costs.next_step(gib, ["tcp"], ["tcp"], always=False) == "diff"  # nothing measured yet
    assert costs.next_step(gib, [], ["tcp"], always=False) == "refresh"  # nobody holds the base: make one
    assert costs.next_step(gib, [], [], always=False) == "plain"  # nobody reached at all
    costs.measured(Sample(0.6, gib, gib // 10, cold=True))  # the first diff allocates: it stands in...
    assert costs.diff_s_per_byte == pytest.approx(0.6 / gib) and not costs.warm
    costs.measured(Sample(0.5, gib, gib // 10, cold=True))  # ...as does the next cold one...
    assert costs.diff_s_per_byte == pytest.approx(0.5 / gib)
    costs.measured(Sample(0.3 / 8, gib // 8, gib // 80, cold=False))  # ...until a warm one: 0.3 s per GiB, 10% patch
    assert costs.diff_s_per_byte == pytest.approx(0.3 / gib) and costs.patch_fraction == pytest.approx(0.1)
    assert costs.warm
    assert costs.diff_pays(gib, ["tcp"])  # no full delivery measured on tcp yet
    # full over tcp: 0.8 s (verified, a refresh), a patch's bytes 0.08 s: 0.38 s < 0.8 s
    costs.delivered("tcp", "full", gib, 0.8, verified=True)
    costs.delivered("shm", "full", gib, 0.3, verified=False)  # shm plain: 0.3 s < 0.3 + 0.03 s
    assert costs.next_step(gib, ["tcp"], ["tcp"], always=False) == "diff"
    assert costs.next_step(gib, ["shm"], ["shm"], always=False) == "plain"
    assert costs.next_step(gib, [], ["shm"], always=False) == "plain"  # no base worth making
    assert costs.next_step(gib, [], ["shm"], always=True) == "refresh"
    assert costs.next_step(gib, ["shm"], ["shm"], always=True) == "diff"
    assert costs.diff_pays(gib, ["shm", "tcp"])  # one diff serves both routes: 0.41 s < 1.1 s
    # a patch delivery over tcp took 0.45 s (applied and verified): 0.3 + 0.45 < 0.8, but tcp
    # never had a plain push to compare with: one goes plain to measure it
    costs.delivered("tcp", "delta", gib, 0.45, verified=True)
    assert costs.next_step(gib, ["tcp"], ["tcp"], always=False) == "plain"
    costs.delivered("tcp", "full", gib, 0.7, verified=False)  # plain: 0.7 s < 0.75 s
    assert costs.next_step(gib, [], ["tcp"], always=False) == "plain"
    costs.diffed(0.9, Diff("c", "d", (), (), 0, gib // 2, gib, cold=True))  # cold: no measurement
    costs.measured(Sample(5.0, gib, 0, cold=True))
    assert costs.diff_s_per_byte == pytest.approx(0.3 / gib)
    costs.measured(Sample(0.1 / 32, gib // 32, gib // 320, cold=False))  # a plain push's sample: less busy now
    assert costs.next_step(gib, [], ["tcp"], always=False) == "refresh"
    costs.diffed(0.1, Diff("c", "d", (), (), 0, gib // 2, gib))
    assert costs.next_step(gib, ["tcp"], ["tcp"], always=False) == "diff"
    # a diff's first eighth, cold or warm, says whether the rest is worth finishing
    assert not costs.diff_would_pay(Sample(0.2, gib // 8, gib // 80, cold=True), gib, ["tcp"])  # 1.6 s
    assert costs.diff_would_pay(Sample(0.01, gib // 8, gib // 80, cold=True), gib, ["tcp"])
    assert costs.diff_s_per_byte == pytest.approx(0.1 / gib)  # asking measures nothing


def test_the_sample_a_plain_push_diffs_is_a_stride_through_the_model() -> None:
    from weightsync.delta import SAMPLE_FRACTION, sample_names
    from weightsync.types import TensorSpec

    def spec(name: str, numel: int) -> TensorSpec:
        return TensorSpec(name, "bfloat16", (numel,), "bfloat16")

    specs = [spec(f"w{i}", 1000 + 37 * i) for i in range(200)]
    names = sample_names(specs)
    sampled = [s for s in specs if s.name in names]
    share = sum(s.shape[0] for s in sampled) / sum(s.shape[0] for s in specs)
    assert SAMPLE_FRACTION / 2 < share <= SAMPLE_FRACTION
    first, last = specs.index(sampled[0]), specs.index(sampled[-1])
    assert first < 50 and last >= 150  # spread over the model, not its first tensors
    assert sample_names([spec("big", 10**6), spec("small", 10)]) == {"small"}  # every one is large
    assert sample_names([]) == frozenset()


class _Measured:
    """`Costs` whose diffs measure what a test says, whatever this host takes."""

    def __init__(self, costs, diff_s_per_byte: float | None) -> None:
        self.costs, self.diff_s_per_byte, self.samples = costs, diff_s_per_byte, []

    def __call__(self, sample) -> None:
        self.samples.append(sample)
        if self.diff_s_per_byte is not None:
            self.costs.diff_s_per_byte, self.costs.patch_fraction = self.diff_s_per_byte, 0.03
            self.costs.delta_s_per_byte.clear()  # a patch then costs its bytes at the full rate


def _push_steps(sender, dest, receiver, trainer, versions) -> tuple[list[str], list[str]]:
    modes, digests = [], []
    for version in versions:
        trainer.step()
        report = sender.push(trainer.state(), version)
        assert report.ok, report.failed
        assert_all_bit_exact(dest, trainer.as_sent())
        assert receiver.content_digest == report.content_digest
        modes.append(report.outcomes[0].mode)
        digests.append(report.content_digest)
        if report.outcomes[0].mode == "full":
            assert report.outcomes[0].wire_bytes == report.total_bytes and report.changed_fraction == 1.0
    return modes, digests


def test_a_sender_whose_diffs_do_not_pay_pushes_plain_and_keeps_measuring_on_a_sample(monkeypatch) -> None:
    trainer = Trainer(seed=8)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, "tcp") as receiver,
        sending(receiver.address, cast=torch.bfloat16, delta=True, bucket_bytes=BUCKET) as sender,
    ):
        # 0: nobody at a base, a refresh; 1: nothing measured yet, a diff (cold: it stands in)
        modes, digests = _push_steps(sender, dest, receiver, trainer, range(2))
        assert modes == ["full", "delta"] and all(digests)
        # as if a diff cost a second per byte: plain pushes as without delta (no checksums, no
        # content digest), each diffing its sample of the tensors as they are packed
        measured = _Measured(sender._costs, diff_s_per_byte=1.0)
        sender._costs.diff_s_per_byte, sender._costs.patch_fraction = 1.0, 0.03
        monkeypatch.setattr(sender._costs, "measured", measured)
        modes, digests = _push_steps(sender, dest, receiver, trainer, range(2, 6))
        assert modes == ["full"] * 4 and digests == [""] * 4
        assert len(measured.samples) == 4 and all(s.nbytes > 0 and s.seconds > 0 for s in measured.samples)
        assert all(not s.cold for s in measured.samples[1:])  # the sample's base is kept up to date
        # 6: a plain push whose sample finds diffs cheap again; 7: a refresh (verified, a base);
        # 8: a diff (what its delivery measures on this host decides the next)
        measured.diff_s_per_byte = 0.0
        modes, digests = _push_steps(sender, dest, receiver, trainer, range(6, 9))
        assert modes == ["full", "full", "delta"] and digests[0] == "" and all(digests[1:])


def test_a_diff_whose_first_part_does_not_pay_stops_and_the_push_goes_plain(monkeypatch) -> None:
    trainer = Trainer(seed=10)
    dest = zeros_like_sent(trainer)
    with (
        receiving(dest, "tcp") as receiver,
        sending(receiver.address, cast=torch.bfloat16, delta=True, bucket_bytes=BUCKET) as sender,
    ):
        modes, _ = _push_steps(sender, dest, receiver, trainer, range(2))  # refresh, then a diff
        assert modes == ["full", "delta"]
        sender._costs.diff_s_per_byte = None  # unmeasured: the next push diffs...
        parts = []

        def too_slow(part, full_bytes, routes) -> bool:  # ...and its first part measures slow
            parts.append(part)
            return False

        monkeypatch.setattr(sender._costs, "diff_would_pay", too_slow)
        measured = _Measured(sender._costs, diff_s_per_byte=1.0)
        monkeypatch.setattr(sender._costs, "measured", measured)
        modes, digests = _push_steps(sender, dest, receiver, trainer, range(2, 4))
        # 2: the diff stopped after its first eighth, the push went plain (nothing sampled: part
        # of the baseline is new already); 3: nobody at a base, plain, sampled
        assert modes == ["full", "full"] and digests == ["", ""]
        model_bytes = sum(t.numel() * t.element_size() for t in dest.values())
        assert len(parts) == 1 and model_bytes / 8 <= parts[0].nbytes < model_bytes
        assert measured.samples == [parts[0], measured.samples[1]] and len(measured.samples) == 2


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
        process.sending(
            receiver.address, cast=torch.bfloat16, delta=True, delta_policy="always", bucket_bytes=BUCKET
        ) as sender,
    ):
        for version in range(4):
            if version:
                trainer.step()
            report = sender.push(trainer.state(), version)
            assert report.ok, report.failed
            assert report.outcomes[0].mode == ("full" if version == 0 else "delta")
            assert_all_bit_exact({name: t.cpu() for name, t in dest.items()}, trainer.as_sent())
            assert receiver.content_digest == report.content_digest != ""
