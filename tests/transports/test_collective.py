"""The collective transport beyond the shared contract: a process group formed once per
membership and rebuilt when it changes, one receiver's failure drained instead of stalling the
others, sockets bound only where the control connection runs, and hostile group messages
refused. (The contract suite and the fault cases in tests/test_failures.py run on it too.)"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import psutil
import pytest
import torch

from tests.helpers import WAIT_S, Recorder, assert_all_bit_exact, random_tensor, receiving, sending
from tests.unit.test_wire import RawPeer
from weightsync import TensorDictSink, WeightSink
from weightsync.messages import Accept, Failed, Offer
from weightsync.plan import build_plan, plan_id, wire_specs
from weightsync.source import as_source
from weightsync.transports import collective
from weightsync.transports.collective import Group


@pytest.fixture
def groups_formed(caplog: pytest.LogCaptureFixture) -> Callable[[], list[int]]:
    """The process groups the sender (rank 0) formed so far: the size of each, as it logs them."""
    caplog.set_level(logging.INFO, logger=collective.__name__)

    def sizes() -> list[int]:
        records = [r for r in caplog.records if r.name == collective.__name__]
        return [r.args[0] for r in records if r.msg.startswith("collective: formed a process group")]  # type: ignore[index]

    return sizes


def test_one_group_per_membership_reused_across_versions(groups_formed):
    source = {"big": random_tensor(torch.float32, (40_000,), seed=1), "small": torch.arange(7)}
    dests = [{name: torch.zeros_like(t) for name, t in source.items()} for _ in range(3)]
    with (
        receiving(dests[0], "collective") as a,
        receiving(dests[1], "collective") as b,
        receiving(dests[2], "collective") as c,
        sending([a.address, b.address, c.address], bucket_bytes=4096, verify="full") as sender,
    ):
        for version in range(1, 5):
            source["big"].add_(1.0)
            report = sender.push(source, version=version)
            assert report.ok, report.failed
            assert report.num_buckets > 30, "the big tensor is chunked across many buckets"
            for dest in dests:
                assert_all_bit_exact(dest, source)
        assert groups_formed() == [4], "one group of the sender and 3 receivers, formed once"
        assert {a.version, b.version, c.version} == {4}


def test_group_is_rebuilt_when_a_receiver_refuses_a_plan_and_again_when_it_returns(groups_formed):
    picky = {"w": torch.zeros(1000)}
    easy = {"w": torch.zeros(1000), "extra": torch.zeros(3)}
    with (
        receiving(picky, "collective") as refusing,
        receiving(TensorDictSink(easy, strict=False), "collective") as accepting,
        sending([refusing.address, accepting.address], bucket_bytes=1024, raise_on_failure=False) as sender,
    ):
        assert sender.push({"w": torch.ones(1000)}, version=1).ok
        report = sender.push({"w": torch.ones(1000), "extra": torch.ones(3)}, version=2)
        assert [(o.address, o.kind) for o in report.failed] == [(refusing.address, "PlanError")]
        assert accepting.version == 2 and refusing.version == 1
        assert sender.push({"w": torch.full((1000,), 3.0)}, version=3).ok
        assert torch.equal(picky["w"], torch.full((1000,), 3.0))
    assert groups_formed() == [3, 2, 3]


class FailsFirstLoad(WeightSink):
    def __init__(self) -> None:
        self.failed = False

    def load(self, named):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            raise RuntimeError("engine refused the first bucket")


def test_buckets_cut_in_many_chunks_arrive_bit_exact_at_every_rank_of_a_long_chain(monkeypatch):
    monkeypatch.setattr(collective, "CHUNK_BYTES", 1000)  # 8192-byte buckets: 9 chunks, the last short
    source = {
        "big": random_tensor(torch.bfloat16, (50_001,), seed=3),
        "odd": random_tensor(torch.uint8, (777,), seed=4),
    }
    dests = [{name: torch.zeros_like(t) for name, t in source.items()} for _ in range(4)]
    with contextlib.ExitStack() as stack:
        receivers = [stack.enter_context(receiving(dest, "collective")) for dest in dests]
        sender = stack.enter_context(sending([r.address for r in receivers], bucket_bytes=8192, verify="full"))
        for version in (1, 2):
            source["big"].add_(1.0)
            assert sender.push(source, version=version).ok
            for dest in dests:  # rank 4 got every chunk through ranks 1, 2 and 3
                assert_all_bit_exact(dest, source)


def test_a_receiver_failing_mid_sync_keeps_forwarding_and_does_not_hold_the_others_up():
    source = {f"t{i}": torch.full((1024,), float(i)) for i in range(16)}
    dest = {name: torch.zeros(1024) for name in source}
    with (
        receiving(FailsFirstLoad(), "collective") as failing,
        receiving(dest, "collective") as healthy,
        sending(
            [failing.address, healthy.address], bucket_bytes=4096, timeout=WAIT_S, raise_on_failure=False
        ) as sender,
    ):
        report = sender.push(source, version=1)
        assert [(o.address, o.kind) for o in report.failed] == [(failing.address, "SinkError")]
        assert "first bucket" in report.failed[0].error
        # The failing one is rank 1: had it stopped forwarding, rank 2 would have waited until the timeout.
        assert report.seconds < WAIT_S / 2
        assert healthy.version == 1
        assert_all_bit_exact(dest, source)
        assert sender.push(source, version=2).ok


def listening() -> set[tuple[str, int]]:
    me = psutil.Process()
    return {tuple(c.laddr) for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def test_rendezvous_and_group_listen_only_on_the_control_connections_address():
    seen: list[set[tuple[str, int]]] = []

    class Snoop(Recorder):
        def commit(self, version):  # type: ignore[no-untyped-def]
            seen.append(listening())
            super().commit(version)

    before = listening()  # whatever else this process listens on (other tests' leftovers)
    with receiving(Snoop(), "collective") as receiver, sending(receiver.address) as sender:
        assert sender.push({"w": torch.ones(64)}, version=1).ok
    (during,) = seen
    opened = during - before
    assert len(opened) >= 3, "receiver control port, sender's store, the group's sockets"
    assert {host for host, _ in opened} == {"127.0.0.1"}


def _offer(version: int = 1) -> Offer:
    plan = build_plan(wire_specs(as_source({"w": torch.ones(64)}).metas(), None), 1024)
    return Offer(version, plan, plan_id(plan))


@pytest.mark.parametrize(
    "group",
    [
        Group("127.0.0.1", 1, "p", 0, 2, "gloo"),  # rank 0 is the sender's
        Group("127.0.0.1", 1, "p", 2, 2, "gloo"),  # rank outside the world
        Group("127.0.0.1", 1, "p", 1, 10**9, "gloo"),  # absurd world size
        Group("127.0.0.1", 1, "p", 1, 2, "mpi"),  # a backend we do not run
    ],
    ids=["rank-zero", "rank-past-world", "huge-world", "unknown-backend"],
)
def test_hostile_group_message_is_refused_before_any_rendezvous(group):
    sink = Recorder()
    with receiving(sink, "collective", timeout=WAIT_S) as receiver:
        peer = RawPeer(receiver.address)
        try:
            peer.hello()
            peer.send(_offer())
            assert isinstance(peer.recv(), Accept)
            peer.send(group)
            reply = peer.recv()
        finally:
            peer.close()
        assert isinstance(reply, Failed) and reply.kind == "ProtocolError", reply
        assert receiver.state == "empty" and receiver.version is None


def test_unreachable_rendezvous_fails_within_the_timeout():
    sink = Recorder()
    with receiving(sink, "collective", timeout=1.0) as receiver:
        peer = RawPeer(receiver.address)
        try:
            peer.hello()
            peer.send(_offer())
            assert isinstance(peer.recv(), Accept)
            peer.send(Group("127.0.0.1", 1, "nobody-home", 1, 2, "gloo"))  # port 1: nothing listens
            reply = peer.recv()
        finally:
            peer.close()
        assert isinstance(reply, Failed) and reply.kind == "CollectiveError", reply
        assert "rendezvous" in reply.message
