"""The joining of a sharded sync's parts (`weightsync.parts`), alone: no thread, no socket. Each
receiver connection is a `Sender` value, each sync a plain object; the fault orders are the ones
`tests/transports/test_sharded.py` drives through real senders (a sender that leaves before it
offers its part, one that leaves between syncs, a departure that leaves too few senders)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync.checksum import combine_shares
from weightsync.errors import ChecksumError, NegotiationError, SinkError, TransferTimeout
from weightsync.messages import Offer, TensorShare, TensorSpec
from weightsync.parts import Complete, Impossible, Parts, Refused, Sender, Wait
from weightsync.plan import build_plan, plan_id

PLAN = build_plan([TensorSpec("w", "float32", (8,), "float32")], 64)


def offer(part: int, parts: int = 2, version: int = 1) -> Offer:
    plan = msgspec.structs.replace(PLAN, parts=tuple(range(parts)))
    return Offer(version, plan, plan_id(plan), "bucket", part=part)


def shares(seed: int) -> tuple[TensorShare, ...]:
    return (TensorShare("w", "float32", (8,), seed), TensorShare("v", "int64", (2,), seed * 7 + 1))


class Syncs:
    """The receiver's side: each `begin` starts a new sync (an object the joining compares)."""

    def __init__(self) -> None:
        self.begun: list[object] = []

    def begin(self) -> object:
        self.begun.append(sync := object())
        return sync


def senders(parts: Parts[object], count: int) -> list[Sender]:
    return [parts.arrive(parts.connect()) for _ in range(count)]


def test_the_parts_join_one_sync_and_the_last_to_commit_commits_it_for_all() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    syncs = Syncs()
    senders(parts, 2)
    sync = parts.join(offer(1), syncs.begin)
    assert parts.join(offer(0), syncs.begin) is sync and syncs.begun == [sync], "one sync, begun once"
    waiting = parts.commit(sync, 1, shares(1), 1)
    assert isinstance(waiting, Wait)
    complete = parts.commit(sync, 0, shares(0), 1)
    assert complete == Complete(combine_shares([shares(0), shares(1)]))
    parts.end(sync, None)
    assert parts.wait(waiting) == complete.digest


def test_an_unverified_sync_commits_no_digest() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    sync = parts.join(offer(0, parts=1), Syncs().begin)
    assert parts.commit(sync, 0, (), 1) == Complete("")


def test_a_part_offered_twice_is_refused() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    parts.join(offer(0), Syncs().begin)
    with pytest.raises(NegotiationError, match="part 0 of version 1 was offered twice"):
        parts.join(offer(0), Syncs().begin)


def test_an_offer_of_another_version_is_for_the_receiver_to_begin_or_refuse() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    first = parts.join(offer(0), Syncs().begin)

    def busy() -> object:
        raise NegotiationError("receiver is busy with another sync")

    with pytest.raises(NegotiationError, match="busy"):
        parts.join(offer(1, version=2), busy)
    assert parts.join(offer(1), Syncs().begin) is first, "version 1 is still in progress"


def test_a_failed_begin_leaves_no_sync_in_progress() -> None:
    parts: Parts[object] = Parts(timeout=1.0)

    def fails() -> object:
        raise SinkError("the sink refused")

    with pytest.raises(SinkError):
        parts.join(offer(0), fails)
    syncs = Syncs()
    assert parts.join(offer(1), syncs.begin) is syncs.begun[0], "the next offer begins the sync"


def test_shares_from_some_parts_only_fail_the_commit() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    sync = parts.join(offer(0), Syncs().begin)
    parts.join(offer(1), Syncs().begin)
    parts.commit(sync, 0, shares(0), 1)
    with pytest.raises(ChecksumError, match=r"the commits of parts \[1\] carry no hashes"):
        parts.commit(sync, 1, (), 1)


def test_a_part_that_waits_hears_the_failure_or_the_timeout() -> None:
    parts: Parts[object] = Parts(timeout=0.0)
    sync = parts.join(offer(0, parts=3), Syncs().begin)
    waiting = parts.commit(sync, 0, shares(0), 1)
    assert isinstance(waiting, Wait)
    with pytest.raises(TransferTimeout, match=r"version 1: parts \[1, 2\] did not land in time"):
        parts.wait(waiting)
    parts.end(sync, RuntimeError("lost down"))
    with pytest.raises(SinkError, match="version 1 did not commit: lost down"):
        parts.wait(waiting)
    with pytest.raises(SinkError, match="the sync of this part ended already"):
        parts.commit(sync, 1, shares(1), 1)


def test_ending_another_sync_leaves_the_sync_in_progress() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    sync = parts.join(offer(0), Syncs().begin)
    parts.end(object(), None)  # a plain sync's end
    assert isinstance(parts.commit(sync, 0, shares(0), 1), Wait)


def synced_both(parts: Parts[object], pair: list[Sender]) -> tuple[list[Sender], object]:
    """Both senders push version 1, a part each, and it commits; the senders as they are then."""
    syncs = Syncs()
    pair = [sender.offering(offer(part)) for part, sender in enumerate(pair)]
    sync = parts.join(offer(0), syncs.begin)
    parts.join(offer(1), syncs.begin)
    parts.commit(sync, 0, shares(0), 1)
    parts.commit(sync, 1, shares(1), 1)
    parts.end(sync, None)
    return [parts.synced(sender) for sender in pair], sync


def test_a_sender_that_left_between_syncs_makes_the_next_sync_refused() -> None:
    """The order "before the offer": rank 1 pushed its part of version 1 and left; rank 0's
    offer of version 2 is refused at once, not left to wait for part 1."""
    parts: Parts[object] = Parts(timeout=1.0)
    pair, _ = synced_both(parts, senders(parts, 2))
    assert parts.leave(pair[1]) is None
    refused = parts.join(offer(0, version=2), Syncs().begin)
    assert isinstance(refused, Refused)
    assert "the sender of part 1 closed its connection; version 2 refused" in str(refused.error)


def test_a_sender_that_arrived_since_may_send_the_part_of_the_one_that_left() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    pair, _ = synced_both(parts, senders(parts, 2))
    parts.leave(pair[1])
    parts.arrive(parts.connect())  # rank 1's replacement
    assert not isinstance(parts.join(offer(0, version=2), Syncs().begin), Refused)


def test_a_part_offered_again_is_no_longer_gone() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    pair, _ = synced_both(parts, senders(parts, 2))
    parts.leave(pair[1])
    assert not isinstance(parts.join(offer(1, version=2), Syncs().begin), Refused), "its part came"


def test_a_sender_that_left_after_another_arrived_leaves_no_part_gone() -> None:
    """A handshake after the leaving sender's last sync may be its replacement."""
    parts: Parts[object] = Parts(timeout=1.0)
    pair, _ = synced_both(parts, senders(parts, 2))
    parts.arrive(parts.connect())
    parts.leave(pair[1])
    assert not isinstance(parts.join(offer(0, version=2), Syncs().begin), Refused)


def test_the_sender_of_a_missing_part_that_leaves_mid_sync_makes_it_impossible() -> None:
    """The order "during the sync": version 2 waits for part 1, whose sender (it sent part 1 of
    version 1) leaves: no connected sender is left to send it."""
    parts: Parts[object] = Parts(timeout=1.0)
    pair, _ = synced_both(parts, senders(parts, 2))
    sync = parts.join(offer(0, version=2), Syncs().begin)
    assert parts.leave(pair[1]) == Impossible(
        sync, 2, "the sender of part 1 closed its connection before it offered its part"
    )


def test_a_sender_that_leaves_before_its_first_part_makes_the_sync_impossible() -> None:
    """The order "before its first part": rank 1 connected and never offered; version 1 waits for it."""
    parts: Parts[object] = Parts(timeout=1.0)
    rank0, rank1 = senders(parts, 2)
    sync = parts.join(offer(0), Syncs().begin)
    expected = "a sender closed its connection: parts [1] of the sync cannot come from 0 other senders"
    assert parts.leave(rank1) == Impossible(sync, 1, expected)


def test_a_departure_from_a_sync_short_of_senders_already_leaves_it_waiting() -> None:
    """Three parts, two senders: the sync waits for a third to connect; the second leaving does
    not decide it (the senders missing may still connect)."""
    parts: Parts[object] = Parts(timeout=1.0)
    _, idle = senders(parts, 2)
    parts.join(offer(0, parts=3), Syncs().begin)
    assert parts.leave(idle) is None


def test_a_sender_refused_before_its_handshake_counts_only_as_connected() -> None:
    parts: Parts[object] = Parts(timeout=1.0)
    rank0 = parts.arrive(parts.connect())
    sync = parts.join(offer(0, parts=2), Syncs().begin)
    refused = parts.connect()  # welcomed, then failed its Auth
    parts.arrive(parts.connect())
    assert parts.leave(refused) is None, "one sender is still there for part 1"
    assert rank0.met == 1 and isinstance(parts.commit(sync, 0, shares(0), 1), Wait), "still in progress"


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(st.permutations(range(n)), st.permutations(range(n)))))
def test_in_any_order_of_offers_and_commits_the_last_commit_completes_the_sync(
    orders: tuple[list[int], list[int]],
) -> None:
    joins, commits = orders
    parts: Parts[object] = Parts(timeout=0.0)
    syncs = Syncs()
    senders(parts, len(joins))
    for part in joins:
        assert parts.join(offer(part, parts=len(joins)), syncs.begin) is syncs.begun[0]
    answers = [parts.commit(syncs.begun[0], part, shares(part), 1) for part in commits]
    digest = combine_shares([shares(part) for part in range(len(joins))])
    assert answers[-1] == Complete(digest) and all(isinstance(answer, Wait) for answer in answers[:-1])
    parts.end(syncs.begun[0], None)
    assert all(parts.wait(answer) == digest for answer in answers[:-1] if isinstance(answer, Wait))


EVENTS = st.lists(st.tuples(st.sampled_from(["connect", "offer", "leave"]), st.integers(0, 3)), max_size=24)


@given(st.integers(1, 3), EVENTS)
def test_a_departure_makes_the_sync_impossible_exactly_when_it_leaves_too_few_senders(
    count: int, events: list[tuple[str, int]]
) -> None:
    """Senders connect, offer the next missing part of one sync of `count` parts, or leave (not
    one that offered: its connection is busy with the sync); kept independently here: who is
    connected, who offered. A departure answers `Impossible` exactly when, after it, fewer
    connected senders are yet to offer than parts missing, and before it there were enough."""
    parts: Parts[object] = Parts(timeout=1.0)
    syncs = Syncs()
    idle: list[Sender] = []  # connected, yet to offer
    offered: list[int] = []
    for kind, which in events:
        missing = count - len(offered)
        if kind == "connect":
            idle.append(parts.arrive(parts.connect()))
        elif kind == "offer" and idle and missing:
            part = len(offered)
            idle.pop(which % len(idle))
            assert not isinstance(parts.join(offer(part, parts=count), syncs.begin), Refused)
            offered.append(part)
        elif kind == "leave" and idle:
            answer = parts.leave(idle.pop(which % len(idle)))
            in_progress = bool(offered) and missing > 0
            impossible = in_progress and len(idle) < missing <= len(idle) + 1
            assert (answer is not None) == impossible, (answer, offered, len(idle), missing)
            if answer is not None:
                assert answer.sync is syncs.begun[0] and answer.version == 1
                return
