"""nixl's own cases: an optional package, refused cleanly where it is missing; what a receiver
exposes, and when it exposes it again; where the bytes go (in place, through a slot, packed)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import (
    Recorder,
    assert_all_bit_exact,
    needs,
    random_tensor,
    random_values,
    receiving,
    sending,
)
from weightsync import ConfigError, WeightReceiver, WeightSender

needs_nixl = needs("nixl")


@pytest.fixture
def without_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as if NIXL were not installed (a None entry makes the import fail)."""
    for name in ("nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.usefixtures("without_nixl")
def test_without_nixl_both_ends_refuse_in_one_line_naming_the_extra():
    for build in (
        lambda: WeightReceiver({}, transport="nixl").start(),
        lambda: WeightSender(["nixl://127.0.0.1:9"]),
    ):
        with pytest.raises(ConfigError) as caught:
            build()
        message = str(caught.value)
        assert "pip install 'weightsync[nixl]'" in message and "\n" not in message


@pytest.mark.usefixtures("without_nixl")
def test_without_nixl_the_other_transports_work():
    dest = {"w": torch.zeros(8)}
    with receiving(dest, "tcp") as receiver, sending(receiver.address) as sender:
        assert sender.push({"w": torch.ones(8)}, version=1).ok
    assert bool((dest["w"] == 1).all())


# --- with NIXL --------------------------------------------------------------------------------


@pytest.fixture
def agents(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roles of the NIXL agents made during the test, in order."""
    from weightsync.transports import nixl, nixl_receive

    made: list[str] = []

    class Counted(nixl.NixlAgent):
        def __init__(self, role: str) -> None:
            made.append(role)
            super().__init__(role)

    for side in (nixl, nixl_receive):
        monkeypatch.setattr(side, "NixlAgent", Counted)
    return made


@pytest.fixture
def copies_in(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tensors the receiver copied bytes of (out of a slot) during the test."""
    from weightsync.landing import Landing

    copied: list[str] = []
    original = Landing.copy_in

    def copy_in(self: Landing, piece, data, *, pinned=False):  # type: ignore[no-untyped-def]
        copied.append(self.plan.tensors[piece.tensor].name)
        original(self, piece, data, pinned=pinned)

    monkeypatch.setattr(Landing, "copy_in", copy_in)
    return copied


def registrations() -> int:
    from weightsync.transports.nixl import live_registrations

    return live_registrations()


@needs_nixl
def test_in_place_destinations_are_written_by_the_sender_alone(copies_in):
    """Plain sources into contiguous destinations: the receiver copies nothing; a staged tensor
    (no destination) arrives through a slot, and a cast one through the sender's scratch."""
    source = {
        "a": random_tensor(torch.float32, (3000,), seed=1),
        "b": random_tensor(torch.bfloat16, (50, 70), seed=2),
        "staged": random_tensor(torch.int64, (300,), seed=3),
    }
    dest = {"a": torch.zeros(3000), "b": torch.zeros(50, 70, dtype=torch.bfloat16)}
    sink = Recorder(dest)
    before = registrations()
    with receiving(sink, "nixl") as receiver:
        with sending(receiver.address, bucket_bytes=4096) as sender:
            assert sender.push(source, version=1).ok
        assert copies_in == ["staged"]  # 2400 bytes: one piece, one copy out of a slot
        assert_all_bit_exact(dest | sink.received, source)
        master = {"a": random_values(torch.float64, (3000,), seed=4), "b": source["b"]}
        with sending(receiver.address, bucket_bytes=4096, cast={"a": torch.float32}) as sender:
            assert sender.push(master, version=2).ok
        assert copies_in == ["staged"]
        assert_all_bit_exact(dest, {"a": master["a"].float(), "b": source["b"]})
    assert registrations() == before


@needs_nixl
def test_a_receiver_keeps_its_agent_until_what_it_exposes_changes(agents):
    dest = {"w": torch.zeros(1000)}
    sink = Recorder(dest)  # reads `dest` at every sync, as an engine that swaps tensors would
    with receiving(sink, "nixl") as receiver, sending(receiver.address, bucket_bytes=1024) as sender:
        for version in (1, 2, 3):
            assert sender.push({"w": torch.full((1000,), float(version))}, version=version).ok
        assert agents.count("receiver") == 1 and agents.count("sender") == 1
        dest["w"] = torch.zeros(1000)  # the engine replaced its tensor: expose the new one
        assert sender.push({"w": torch.full((1000,), 4.0)}, version=4).ok
        assert agents.count("receiver") == 2 and agents.count("sender") == 1
    assert bool((dest["w"] == 4.0).all())


def test_collapsing_into_huge_pages_keeps_the_bytes():
    """Best effort everywhere (no huge pages, an old kernel): the contents never change."""
    from weightsync.transports.nixl_agent import address_of, collapse_huge_pages, huge_buffer

    tensor = random_tensor(torch.uint8, (9 << 20,), seed=5)
    before = tensor.clone()
    view = tensor.numpy()[12345:]
    assert collapse_huge_pages(address_of(view), view.nbytes) >= 0.0
    assert torch.equal(tensor, before)
    buffer = huge_buffer(5 << 20)
    assert buffer.nbytes == 5 << 20 and not buffer.any()


def test_collapsing_covers_the_edge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 2 MiB page a range touches is advised, the interior first, then each edge page on
    its own (the kernel stops a range at its first page it cannot collapse)."""
    from weightsync.transports import nixl_agent

    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(nixl_agent, "_madvise_function", lambda start, n, advice: calls.append((start, n, advice)) or 0)
    page = nixl_agent.HUGE_PAGE_BYTES
    nixl_agent.collapse_huge_pages(10 * page + 64, 3 * page)  # touches pages 10 to 13
    collapsed = [(start // page, n // page) for start, n, advice in calls if advice == nixl_agent._MADV_COLLAPSE]
    assert collapsed == [(11, 2), (10, 1), (13, 1)]
    calls.clear()
    nixl_agent.collapse_huge_pages(4 * page + 64, 100)  # inside one page: that page, once
    assert [(start // page, n // page) for start, n, advice in calls if advice == nixl_agent._MADV_COLLAPSE] == [(4, 1)]
    calls.clear()
    nixl_agent.collapse_huge_pages(2 * page, 2 * page)  # aligned: no edge pages
    assert [(start // page, n // page) for start, n, advice in calls if advice == nixl_agent._MADV_COLLAPSE] == [(2, 2)]


@needs_nixl
def test_auto_buckets_grow_past_64_mib_over_nixl_only():
    """Each bucket costs nixl a fixed time and one written in place no memory: "auto" grows to
    the largest tensor up to 256 MiB there (64 MiB elsewhere), within the memory budget."""
    source = {"w": torch.ones(80 << 18)}  # 80 MiB
    dest = {"w": torch.zeros(80 << 18)}
    with receiving(dest, "nixl") as receiver, sending(receiver.address) as sender:
        assert sender.push(source, version=1).bucket_bytes == 80 << 20
    with receiving(dest, "tcp") as receiver, sending(receiver.address) as sender:
        assert sender.push(source, version=2).bucket_bytes == 64 << 20
    assert bool((dest["w"] == 1).all())
