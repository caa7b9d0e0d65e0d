"""Sharded pushes with delta: every rank of a trainer (here threads) diffs the boxes it holds
against its own baseline of them; the ranks exchange their patches' sizes and their shares of the
new version's hash; the receivers at the base get every rank's patch as the parts of one plan and
check the weights it leaves against the ranks' digest. Exact over several steps, rows or boxes
along any dimension, small on the wire; a receiver not at the base gets the full version in the
same push; a corrupted part or drifted weights never commit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers import RowShards, assert_all_bit_exact, pushes_on_threads, receiving
from tests.transports.test_sharded import BoxShards
from weightsync import ConfigError, SyncReport, WeightSender
from weightsync.digest import source_digest
from weightsync.landing import Landing

TIMEOUT_S = 10.0
BUCKET = 1 << 12
"""Small buckets: every rank's patch of a tensor spans several."""


class Group:
    """The ranks' exchange (`source.Exchanges`), over a barrier: what torch.distributed does for
    `ModuleSource` and `MegatronSource`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._values: list[list[int]] = [[] for _ in range(world)]
        self.calls = 0

    def exchange(self, rank: int, values: list[int], timeout: float) -> list[list[int]]:
        self._values[rank] = list(values)
        self._barrier.wait(timeout)
        every = [list(v) for v in self._values]
        self._barrier.wait(timeout)
        self.calls += rank == 0
        return every


def exchanging(split: type[RowShards]) -> type[RowShards]:
    """`split` (a source of one rank's rows or boxes) whose ranks exchange over a `Group`."""

    class Exchanging(split):  # type: ignore[misc, valid-type]
        def __init__(self, full: dict[str, torch.Tensor], rank: int, group: Group) -> None:
            super().__init__(full, rank, group.world)
            self.group = group

        def exchange(self, values: list[int], timeout: float) -> list[list[int]]:
            return self.group.exchange(self.rank, values, timeout)

    return Exchanging


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32, bf16 and fp16 weights (all sent as bf16), a norm; shapes that split unevenly."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn((9, 40), generator=gen),
        "q": torch.randn((8, 8), generator=gen).to(torch.bfloat16),
        "norm": torch.randn((8,), generator=gen),
        "down": torch.randn((8, 12), generator=gen),
        "experts": torch.randn((4, 6, 8), generator=gen).to(torch.float16),
    }


def step(full: dict[str, torch.Tensor], seed: int) -> None:
    """About one element in ten moves (far more than RL's few percent: every box changes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in full.values():
            moved = torch.rand(tensor.shape, generator=gen) < 0.1
            tensor.add_(moved.to(tensor.dtype) * 0.5)


def as_sent(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.bfloat16) for name, t in full.items()}


class Ranks:
    """`world` trainer ranks, each with a sender of its own for the whole test (its baseline
    lives there), pushing its source on a thread of its own."""

    def __init__(self, addresses: list[str], world: int, **options: Any) -> None:
        self.group = Group(world)
        self.senders = [
            WeightSender(addresses, timeout=TIMEOUT_S, bucket_bytes=BUCKET, raise_on_failure=False, **options)
            for _ in range(world)
        ]

    def push(self, sources: list[Any], version: int) -> list[SyncReport]:
        return pushes_on_threads(
            lambda rank: self.senders[rank].push(sources[rank], version=version), len(sources), 4 * TIMEOUT_S
        )

    def step_and_push(self, source: type[RowShards], full: dict[str, torch.Tensor], version: int) -> list[SyncReport]:
        """The trainer steps (`step`, seeded by `version`), then every rank pushes its part."""
        step(full, seed=version)
        return self.push([source(full, rank, self.group) for rank in range(len(self.senders))], version)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


@pytest.fixture
def ranks() -> Iterator[list[Ranks]]:
    made: list[Ranks] = []
    yield made
    for each in made:
        each.close()


@pytest.mark.parametrize("transport", ["tcp", "collective"])
@pytest.mark.parametrize(("split", "world"), [(RowShards, 2), (RowShards, 3), (BoxShards, 2)])
def test_every_rank_patches_what_it_holds_and_the_receivers_land_it_exact(
    transport: str, split: type[RowShards], world: int, ranks: list[Ranks]
) -> None:
    full = model()
    dests = [{name: torch.zeros_like(t) for name, t in as_sent(full).items()} for _ in range(2)]
    source = exchanging(split)
    with receiving(dests[0], transport) as first, receiving(dests[1], transport) as second:
        ranks.append(team := Ranks([first.address, second.address], world, cast=torch.bfloat16, delta=True))
        full_bytes = sum(t.numel() * t.element_size() for t in as_sent(full).values())
        for version in range(1, 6):
            if version > 1:
                step(full, seed=version)
            reports = team.push([source(full, rank, team.group) for rank in range(world)], version)
            assert all(report.ok for report in reports), [report.failed for report in reports]
            digest = source_digest(full, torch.bfloat16)
            for receiver, dest in zip((first, second), dests, strict=True):
                assert receiver.content_digest == digest and receiver.version == version
                assert receiver.status.mode == ("full" if version == 1 else "delta")
                assert_all_bit_exact(dest, as_sent(full))
            modes = {outcome.mode for report in reports for outcome in report.outcomes}
            assert modes == ({"full"} if version == 1 else {"delta"}), (version, modes)
            if version > 1:
                sent = sum(report.outcomes[0].wire_bytes for report in reports)  # every rank's part
                assert 0 < sent < full_bytes, (sent, full_bytes)
                assert 0 < reports[0].changed_fraction < 0.2
    assert team.group.calls == 5, "the ranks exchange once per push"


@pytest.mark.parametrize("transport", ["tcp"])
def test_a_receiver_not_at_the_base_gets_every_rank_s_full_boxes_in_the_same_push(
    transport: str, ranks: list[Ranks]
) -> None:
    full = model()
    source = exchanging(RowShards)
    dest = {name: torch.zeros_like(t) for name, t in as_sent(full).items()}
    with receiving(dest, transport) as first:
        ranks.append(team := Ranks([first.address], 2, cast=torch.bfloat16, delta=True))
        for version in (1, 2):
            assert all(report.ok for report in team.step_and_push(source, full, version))
        newcomer_dest = {name: torch.zeros_like(t) for name, t in as_sent(full).items()}
        with receiving(newcomer_dest, transport) as newcomer:
            team.close()
            ranks.append(team := Ranks([first.address, newcomer.address], 2, cast=torch.bfloat16, delta=True))
            for version in (3, 4, 5):
                step(full, seed=version)
                reports = team.push([source(full, r, team.group) for r in (0, 1)], version)
                assert all(report.ok for report in reports), [report.failed for report in reports]
                modes = [outcome.mode for outcome in reports[0].outcomes]
                # a new sender has no baseline: one full push, then both receivers take patches
                assert modes == (["full", "full"] if version == 3 else ["delta", "delta"]), (version, modes)
                assert first.content_digest == newcomer.content_digest == source_digest(full, torch.bfloat16)
            assert_all_bit_exact(newcomer_dest, as_sent(full))
        assert_all_bit_exact(dest, as_sent(full))


@pytest.mark.fault(
    "a flipped byte in one rank's patch (sharded delta)",
    expected="ChecksumError; receiver keeps the previous version, or (a part patched live weights) says it holds none; the next push is full and exact",
)
def test_a_corrupted_part_of_a_patch_never_commits_and_the_next_push_is_full(
    monkeypatch: pytest.MonkeyPatch, ranks: list[Ranks], observe: Any
) -> None:
    original = Landing.finish_bucket

    def corrupted(self: Landing, index: int, checksum: int | None = None) -> None:
        piece = self.plan.buckets[index][-1]
        if self.version == 3 and self.delta and index >= self.plan.parts[1] and piece.nbytes:
            self.target(piece)[0] ^= 0x40  # a value byte in rank 1's part
        original(self, index, checksum)

    monkeypatch.setattr(Landing, "finish_bucket", corrupted)
    full = model()
    source = exchanging(RowShards)
    dest = {name: torch.zeros_like(t) for name, t in as_sent(full).items()}
    with receiving(dest, "tcp") as receiver:
        ranks.append(team := Ranks([receiver.address], 2, cast=torch.bfloat16, delta=True))
        for version in (1, 2):
            assert all(report.ok for report in team.step_and_push(source, full, version))
        kept = {name: t.clone() for name, t in dest.items()}
        reports = team.step_and_push(source, full, 3)
        failures = [failure for report in reports for failure in report.failed]
        # rank 1's part fails its checksum; rank 0's hears that the sync did not commit, or (its
        # offer came after the abort) that the receiver holds no base for its patch any more, or
        # that part 1's sender has left (it closes its connection once its part failed: parts.py)
        kinds = {failure.kind for failure in failures}
        expected = {"ChecksumError", "SinkError", "NegotiationError", "PeerClosedError"}
        assert "ChecksumError" in kinds and kinds <= expected, failures
        assert receiver.status.delta_base == ""
        after = (receiver.state, receiver.version)
        # rank 1's bucket is checked before its patches apply; rank 0's part may have patched the
        # tensors it alone holds by then (live destinations): then the receiver holds no version
        assert after in {("ready", 2), ("dirty", None)}, after
        if after == ("ready", 2):
            assert_all_bit_exact(dest, kept)
        reports = team.step_and_push(source, full, 4)
        assert all(report.ok and report.outcomes[0].mode == "full" for report in reports)
        found = next(failure for failure in failures if failure.kind == "ChecksumError")
        observe(f"`{found.kind}: {found.error[:80]}`; receiver after: {after}; version 4 full and exact")
    assert_all_bit_exact(dest, as_sent(full))


@pytest.mark.fault(
    "a sharded patch onto drifted weights (sharded delta)",
    expected="ChecksumError from the ranks' content digest; receiver dirty (holds no version); the next push is full and exact",
)
def test_a_sharded_patch_onto_drifted_weights_fails_the_ranks_digest(ranks: list[Ranks], observe: Any) -> None:
    full = model()
    source = exchanging(BoxShards)
    dest = {name: torch.zeros_like(t) for name, t in as_sent(full).items()}
    with receiving(dest, "tcp") as receiver:
        ranks.append(team := Ranks([receiver.address], 2, cast=torch.bfloat16, delta=True))
        for version in (1, 2):
            assert all(report.ok for report in team.step_and_push(source, full, version))
        dest["down"][0, 0] += 1.0  # behind the sync's back
        reports = team.step_and_push(source, full, 3)
        failures = [failure for report in reports for failure in report.failed]
        # the rank whose commit found it says ChecksumError; the other that its part did not commit, and why
        assert failures and all("content digest differs from the sender's" in f.error for f in failures), failures
        assert "ChecksumError" in {failure.kind for failure in failures}, failures
        assert (receiver.state, receiver.version) == ("dirty", None)  # patched live weights that were not the base
        reports = team.step_and_push(source, full, 4)
        assert all(report.ok and report.outcomes[0].mode == "full" for report in reports)
        found = next(failure for failure in failures if failure.kind == "ChecksumError")
        observe(f"`{found.kind}: {found.error[:80]}`; receiver dirty; version 4 full and exact")
    assert_all_bit_exact(dest, as_sent(full))


def test_a_sharded_source_whose_ranks_cannot_exchange_is_refused_with_delta() -> None:
    full = model()
    with receiving({name: torch.zeros_like(t) for name, t in as_sent(full).items()}, "tcp") as receiver:
        with WeightSender([receiver.address], timeout=TIMEOUT_S, delta=True) as sender:
            with pytest.raises(ConfigError, match="exchange their patch sizes; RowShards has no `exchange`"):
                sender.push(RowShards(full, 0, 2), version=1)
        assert receiver.version is None


def test_the_parts_of_a_patch_never_share_arena_space() -> None:
    """The parts of a sharded sync land side by side, in no one order: a receiver's arena gives
    every staged tensor a place of its own (reusing the space of one whose buckets went by, as a
    plan from one sender may, would let a part overwrite another's bytes)."""
    from weightsync.delta import patch_plan
    from weightsync.plan import arena_layout, tensor_nbytes, wire_specs
    from weightsync.source import TensorMeta

    specs = wire_specs([TensorMeta(f"t{i}", (64, 64), torch.float32) for i in range(4)], None)
    plan = patch_plan(specs, [[300, 0, 200, 0], [0, 300, 0, 200]], 4096)  # rank 0: t0, t2; rank 1: t1, t3
    offsets, size = arena_layout(plan, range(4), in_order=False)
    regions = sorted((offsets[t], offsets[t] + tensor_nbytes(plan.tensors[t])) for t in range(4))
    assert all(end <= start for (_, end), (start, _) in zip(regions, regions[1:], strict=False))
    assert size >= sum(tensor_nbytes(spec) for spec in plan.tensors)
    reused, _ = arena_layout(plan, range(4))  # in plan order, t0's and t1's space is reused
    assert len(set(reused.values())) < 4
