"""regions.py: the slice plan of a sharded sync. A part plan covers every byte of every box
exactly once, each part carries exactly the rows its rank holds, every rank computes the same
plan, and check_plan accepts it (and refuses parts that overlap, leave a gap or break order)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weightsync import PlanError
from weightsync.messages import Piece, Plan, TensorSpec, Want
from weightsync.plan import check_plan, part_buckets, tensor_nbytes
from weightsync.regions import checked_wants, cuts, held_runs, part_plan, receiver_specs, region_view, sent_whole
from weightsync.source import SourceLayout, chunk_rows


def spec(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, "float32", shape, "float32")


SPECS = [spec("embed", 10, 4), spec("norm", 4), spec("o", 6, 8), spec("scalar"), spec("empty", 0, 3)]


def layout(rank: int, world: int, specs: list[TensorSpec] = SPECS) -> SourceLayout:
    rows = tuple(chunk_rows(s.shape[0], world) if s.shape and s.name != "norm" else None for s in specs)
    return SourceLayout.from_rows(rank, world, rows)


def test_chunk_rows_cuts_as_torch_chunk_does() -> None:
    for rows in range(12):
        for world in (1, 2, 3, 4):
            bounds = chunk_rows(rows, world)
            chunks = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
            sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            assert [s for s in sizes if s] == [c for c in chunks if c]
            assert bounds[0] == 0 and bounds[-1] == rows


def test_wants_become_boxes_and_whole_boxes_are_left_out() -> None:
    wants = [Want("embed", (5, 0), (10, 4)), Want("norm", (0,), (4,)), Want("other", (0,), (1,))]
    assert checked_wants(wants, SPECS) == {"embed": ((5, 0), (10, 4))}
    for bad in (Want("embed", (5, 0), (11, 4)), Want("embed", (5,), (10,)), Want("o", (3, 2), (2, 4))):
        with pytest.raises(PlanError, match="wants"):
            checked_wants([bad], SPECS)
    with pytest.raises(PlanError, match="twice"):
        checked_wants([wants[0], wants[0]], SPECS)


def test_a_receiver_is_sent_its_boxes_and_the_other_tensors_whole() -> None:
    sent = receiver_specs(SPECS, {"o": ((0, 4), (6, 8))})
    o = sent[2]
    assert (o.shape, o.region.start, o.region.whole) == ((6, 4), (0, 4), (6, 8))  # type: ignore[union-attr]
    assert [s for i, s in enumerate(sent) if i != 2] == [s for i, s in enumerate(SPECS) if i != 2]
    whole = torch.arange(48.0).reshape(6, 8)
    assert torch.equal(region_view(whole, o), whole[:, 4:])


def test_receivers_are_grouped_by_what_they_keep() -> None:
    keep = [Want("embed", (0, 0), (5, 4)), Want("norm", (0,), (4,))]
    groups, refused = cuts(SPECS, {"a": keep, "b": [], "c": keep, "d": [Want("o", (0, 0), (9, 9))]})
    assert [sorted(addresses) for addresses, _ in groups] == [["a", "c"], ["b"]]
    assert list(refused) == ["d"]
    assert sent_whole(SPECS, {"a": keep, "b": []}) == ("empty", "o", "scalar")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_part_carries_exactly_the_rows_its_rank_holds(world: int) -> None:
    specs = receiver_specs(SPECS, {"embed": ((3, 0), (8, 4)), "o": ((0, 2), (6, 6))})
    plans = [part_plan(specs, layout(rank, world), 128) for rank in range(world)]
    assert all(plan == plans[0] for plan in plans), "every rank computes the same plan"
    plan = plans[0]
    check_plan(plan, 1 << 20)
    assert len(plan.parts or (0,)) == world
    for rank in range(world):
        carried: dict[int, int] = {}
        for index in part_buckets(plan, rank):
            for piece in plan.buckets[index]:
                carried[piece.tensor] = carried.get(piece.tensor, 0) + piece.nbytes
        for tensor, s in enumerate(specs):
            runs = held_runs(s, layout(rank, world).held[tensor][rank])
            assert carried.get(tensor, 0) == sum(nbytes for _, nbytes in runs), (rank, s.name)


def test_check_plan_refuses_parts_that_overlap_leave_gaps_or_break_order() -> None:
    plan = part_plan(SPECS, layout(0, 2), 128)
    check_plan(plan, 1 << 20)
    buckets = [list(bucket) for bucket in plan.buckets]
    first = buckets[0][0]
    twice = msgspec.structs.replace(plan, buckets=(*plan.buckets, (first,)))
    shrunk = msgspec.structs.replace(
        plan,
        buckets=((Piece(first.tensor, first.tensor_offset, 0, first.nbytes - 4), *buckets[0][1:]), *plan.buckets[1:]),
    )
    for bad, why in [
        (twice, "order"),
        (shrunk, "cover"),
        (msgspec.structs.replace(plan, parts=(0, len(plan.buckets) + 1)), "parts"),
        (msgspec.structs.replace(plan, parts=(1, 0)), "parts"),
        (msgspec.structs.replace(plan, buckets=tuple(reversed(plan.buckets)), parts=(0,)), "order|cover"),
    ]:
        with pytest.raises(PlanError, match=why):
            check_plan(bad, 1 << 20)


def test_check_plan_refuses_a_box_outside_its_tensor() -> None:
    (inside,) = receiver_specs([spec("w", 4, 4)], {"w": ((2, 0), (4, 4))})
    outside = msgspec.structs.replace(inside, shape=(3, 4))
    for box, ok in [(inside, True), (outside, False)]:
        plan = part_plan([box], SourceLayout.whole(1), 128)
        plan = msgspec.structs.replace(plan, total_bytes=tensor_nbytes(box))
        if ok:
            check_plan(plan, 1 << 20)
        else:
            with pytest.raises(PlanError, match="does not fit"):
                check_plan(plan, 1 << 20)


@given(
    shapes=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 5)), min_size=1, max_size=5),
    world=st.integers(1, 4),
    bucket=st.integers(1, 8).map(lambda n: n * 64),
    cut=st.integers(0, 4),
)
def test_any_part_plan_covers_every_box_once(shapes: list[tuple[int, int]], world: int, bucket: int, cut: int) -> None:
    specs = [spec(f"t{i}", rows, cols) for i, (rows, cols) in enumerate(shapes)]
    boxes = {s.name: ((min(cut, s.shape[0]), 0), s.shape) for s in specs if cut and s.shape[0] > cut}
    sent = receiver_specs(specs, boxes)
    rows = tuple(chunk_rows(s.shape[0], world) if i % 2 == 0 else None for i, s in enumerate(specs))
    plan = part_plan(sent, SourceLayout.from_rows(0, world, rows), bucket)
    check_plan(plan, 1 << 20)
    assert plan.total_bytes == sum(math.prod(s.shape) * 4 for s in sent)
    assert isinstance(plan, Plan)


def test_a_rank_holding_columns_holds_one_run_per_row_of_its_box() -> None:
    o = spec("o", 3, 8)
    assert held_runs(o, ((0, 3), (2, 6))) == [(8, 16), (40, 16), (72, 16)]
    assert held_runs(o, ()) == held_runs(o, ((0, 3),)) == [(0, 96)]
    assert held_runs(o, None) == held_runs(o, ((3, 3),)) == []
    (rows_1_to_3,) = receiver_specs([o], {"o": ((1, 0), (3, 8))})
    assert held_runs(rows_1_to_3, ((0, 3), (2, 6))) == [(8, 16), (40, 16)]
    assert held_runs(spec("experts", 4, 6, 8), ((0, 4), (0, 2))) == [(192 * e, 64) for e in range(4)]


def test_boxes_that_do_not_cover_a_tensor_once_are_refused() -> None:
    halves = (((0, 3), (0, 4)), ((0, 3), (4, 8)))
    part_plan([spec("o", 3, 8)], SourceLayout(0, 2, (halves,)), 128)
    for bad in [(((0, 3), (0, 4)), ((0, 3), (3, 8))), (((0, 3), (0, 4)), None)]:
        with pytest.raises(PlanError, match="do not cover 'o' once"):
            part_plan([spec("o", 3, 8)], SourceLayout(0, 2, (bad,)), 128)
