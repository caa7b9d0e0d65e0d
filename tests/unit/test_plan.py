"""plan.py: build_plan packs every byte exactly once, aligned, chunked at bucket boundaries, and
check_plan accepts exactly the plans that do (it is the receiver's guard against a hostile peer)."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import DTYPES
from weightsync import ConfigError, PlanError, build_plan
from weightsync.messages import Piece, Plan, TensorSpec
from weightsync.plan import check_plan, plan_id, tensor_nbytes, wire_specs
from weightsync.source import TensorMeta

ALIGN = 64
ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
}

spec_strategy = st.builds(
    lambda index, dtype, shape: TensorSpec(f"t{index}", dtype, shape, dtype),
    st.integers(0, 0),  # renamed below to keep names unique
    st.sampled_from(sorted(ITEMSIZE)),
    st.one_of(
        st.lists(st.integers(0, 5), max_size=3).map(tuple),
        st.integers(0, 700).map(lambda n: (n,)),
    ),
)
specs_strategy = st.lists(spec_strategy, max_size=8).map(
    lambda specs: [TensorSpec(f"t{i}", s.dtype, s.shape, s.source_dtype) for i, s in enumerate(specs)]
)
bucket_strategy = st.integers(1, 40).map(lambda n: n * ALIGN)


def layout(plan: Plan) -> list[list[tuple[int, int, int, int]]]:
    """Each bucket's pieces as (tensor, tensor_offset, bucket_offset, nbytes)."""
    return [[msgspec.structs.astuple(piece) for piece in bucket] for bucket in plan.buckets]


def nbytes_of(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * ITEMSIZE[spec.dtype]


def reference_valid(plan: Plan, max_bucket_bytes: int) -> bool:
    """An independent statement of what a valid plan is, written for clarity, not speed: every
    byte of every tensor is stored exactly once, pieces appear in tensor order, each piece lies
    inside its bucket without overlapping another, never splits an element, and every bucket
    holds something. A zero-byte tensor is one zero-byte piece."""
    if not (0 < plan.bucket_bytes <= max_bucket_bytes and plan.bucket_bytes % ALIGN == 0):
        return False
    if any(spec.dtype not in ITEMSIZE or spec.source_dtype not in ITEMSIZE for spec in plan.tensors):
        return False
    if any(not spec.name or any(d < 0 for d in spec.shape) for spec in plan.tensors):
        return False
    if len({spec.name for spec in plan.tensors}) != len(plan.tensors):
        return False
    sizes = [nbytes_of(spec) for spec in plan.tensors]
    if sum(sizes) != plan.total_bytes:
        return False
    pieces = [piece for bucket in plan.buckets for piece in bucket]
    if any(not bucket for bucket in plan.buckets):
        return False
    covered = [bytearray(size) for size in sizes]
    for bucket in plan.buckets:
        for a, b in itertools.pairwise(bucket):
            if b.bucket_offset < a.bucket_offset + a.nbytes:
                return False  # pieces lie in a bucket in order, none starting inside another
        for piece in bucket:
            if not 0 <= piece.tensor < len(sizes) or piece.nbytes < 0:
                return False
            size, item = sizes[piece.tensor], ITEMSIZE[plan.tensors[piece.tensor].dtype]
            if piece.nbytes == 0 and size > 0:
                return False
            if piece.tensor_offset < 0 or piece.tensor_offset + piece.nbytes > size:
                return False
            if piece.bucket_offset < 0 or piece.bucket_offset + piece.nbytes > plan.bucket_bytes:
                return False
            if piece.tensor_offset % item or piece.nbytes % item:
                return False
            for i in range(piece.tensor_offset, piece.tensor_offset + piece.nbytes):
                if covered[piece.tensor][i]:
                    return False
                covered[piece.tensor][i] = 1
    if not all(all(c) for c in covered):
        return False
    # Order: tensors one after the other, each tensor's pieces by increasing offset, and a
    # zero-byte tensor exactly once.
    expected = [(index, 0) for index in range(len(sizes))]
    order = []
    for piece in pieces:
        if order and order[-1][0] == piece.tensor and piece.tensor_offset > 0:
            continue
        order.append((piece.tensor, piece.tensor_offset))
    if order != expected:
        return False
    return all(
        b.tensor != a.tensor or b.tensor_offset == a.tensor_offset + a.nbytes for a, b in itertools.pairwise(pieces)
    )


# --- build_plan ---------------------------------------------------------------------------------


@settings(max_examples=300)
@given(specs=specs_strategy, bucket_bytes=bucket_strategy)
def test_build_plan_covers_every_byte_once_aligned_and_inside_buckets(specs, bucket_bytes):
    plan = build_plan(specs, bucket_bytes)
    assert plan.bucket_bytes == bucket_bytes
    assert plan.tensors == tuple(specs)
    assert plan.total_bytes == sum(nbytes_of(s) for s in specs)
    assert reference_valid(plan, bucket_bytes)
    check_plan(plan, bucket_bytes)  # what the sender builds, a receiver accepts
    for bucket in plan.buckets:
        for piece in bucket:
            assert piece.bucket_offset % ALIGN == 0, "every piece starts on a 64-byte boundary"


@settings(max_examples=300)
@given(specs=specs_strategy, bucket_bytes=bucket_strategy)
def test_build_plan_chunks_only_what_does_not_fit_and_fills_buckets_greedily(specs, bucket_bytes):
    plan = build_plan(specs, bucket_bytes)
    pieces_of: dict[int, list[tuple[int, Piece]]] = {}
    for index, bucket in enumerate(plan.buckets):
        for piece in bucket:
            pieces_of.setdefault(piece.tensor, []).append((index, piece))
    for tensor, spec in enumerate(specs):
        size, pieces = nbytes_of(spec), pieces_of[tensor]
        if size <= bucket_bytes:
            assert len(pieces) == 1, f"a tensor that fits a bucket is never split ({size} <= {bucket_bytes})"
        else:
            buckets = [index for index, _ in pieces]
            assert buckets == list(range(buckets[0], buckets[0] + len(buckets))), "chunks in consecutive buckets"
            for _, middle in pieces[1:-1]:
                assert (middle.bucket_offset, middle.nbytes) == (0, bucket_bytes), "middle chunks fill a bucket"
            assert pieces[-1][1].bucket_offset == 0
            # the first chunk fills the rest of the bucket it starts in
            first = pieces[0][1]
            assert first.bucket_offset + first.nbytes == bucket_bytes
    # Greedy: a bucket is only closed when the next tensor could not start in it.
    for left, right in itertools.pairwise(plan.buckets):
        head = right[0]
        if head.tensor_offset > 0:
            continue  # a chunk continuing: the previous bucket is full by the assertion above
        end = -(-(left[-1].bucket_offset + left[-1].nbytes) // ALIGN) * ALIGN
        head_size = nbytes_of(specs[head.tensor])
        assert end + head_size > bucket_bytes, f"bucket closed early: {head_size} bytes would fit at {end}"


def _one(dtype: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec("w", dtype, shape, dtype)


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        pytest.param([_one("float32", (64,))], [[(0, 0, 0, 256)]], id="exactly-one-bucket"),
        pytest.param([_one("uint8", (257,))], [[(0, 0, 0, 256)], [(0, 256, 0, 1)]], id="one-byte-over"),
        pytest.param([_one("float32", (65,))], [[(0, 0, 0, 256)], [(0, 256, 0, 4)]], id="one-element-over"),
        pytest.param(
            [_one("bfloat16", (128 * 3 + 1,))],
            [[(0, 0, 0, 256)], [(0, 256, 0, 256)], [(0, 512, 0, 256)], [(0, 768, 0, 2)]],
            id="many-times-over",
        ),
        pytest.param(
            [TensorSpec("a", "uint8", (1,), "uint8"), TensorSpec("b", "float32", (64,), "float32")],
            [[(0, 0, 0, 1)], [(1, 0, 0, 256)]],
            id="whole-bucket-tensor-after-a-small-one-starts-a-new-bucket",
        ),
        pytest.param(
            [TensorSpec("a", "uint8", (1,), "uint8"), TensorSpec("b", "float32", (100,), "float32")],
            [[(0, 0, 0, 1), (1, 0, 64, 192)], [(1, 192, 0, 208)]],
            id="chunked-tensor-fills-the-rest-of-the-current-bucket",
        ),
        pytest.param(
            [TensorSpec("a", "uint8", (190,), "uint8"), TensorSpec("b", "float32", (17,), "float32")],
            [[(0, 0, 0, 190)], [(1, 0, 0, 68)]],
            id="aligned-start-past-the-room-left",
        ),
        pytest.param(
            [TensorSpec("a", "float32", (64,), "float32"), TensorSpec("b", "float32", (0,), "float32")],
            [[(0, 0, 0, 256), (1, 0, 256, 0)]],
            id="empty-tensor-at-a-full-bucket-end",
        ),
        pytest.param([], [], id="nothing"),
        pytest.param([_one("float32", ())], [[(0, 0, 0, 4)]], id="zero-dim"),
    ],
)
def test_build_plan_chunk_boundaries(specs, expected):
    plan = build_plan(specs, 256)
    assert layout(plan) == expected
    check_plan(plan, 256)


@pytest.mark.parametrize("bucket_bytes", [0, -64, 63, 65, 100])
def test_build_plan_rejects_unaligned_bucket_sizes(bucket_bytes):
    with pytest.raises(ConfigError, match="multiple of 64"):
        build_plan([_one("float32", (4,))], bucket_bytes)


def test_plan_digest_is_stable_and_sensitive():
    plan = build_plan([_one("float32", (100,))], 128)
    again = build_plan([_one("float32", (100,))], 128)
    other = build_plan([_one("float32", (100,))], 192)
    renamed = build_plan([TensorSpec("v", "float32", (100,), "float32")], 128)
    assert plan_id(plan) == plan_id(again)
    assert len({plan_id(plan), plan_id(other), plan_id(renamed)}) == 3


# --- wire_specs (cast on send) --------------------------------------------------------------------


def test_wire_specs_casts_floating_point_only_and_keeps_the_source_dtype():
    metas = [TensorMeta(f"t{i}", (2, 3), dtype) for i, dtype in enumerate(DTYPES)]
    specs = wire_specs(metas, torch.bfloat16)
    for meta, spec in zip(metas, specs, strict=True):
        floating = meta.dtype.is_floating_point and meta.dtype.itemsize > 1
        assert spec.dtype == ("bfloat16" if floating else str(meta.dtype).removeprefix("torch."))
        assert spec.source_dtype == str(meta.dtype).removeprefix("torch.")
        assert spec.shape == (2, 3)


def test_wire_specs_cast_mapping_applies_per_name():
    metas = [TensorMeta("a", (4,), torch.float32), TensorMeta("b", (4,), torch.float32)]
    specs = wire_specs(metas, {"a": torch.float16})
    assert [(s.dtype, s.source_dtype) for s in specs] == [("float16", "float32"), ("float32", "float32")]
    assert wire_specs(metas) == wire_specs(metas, None)
    assert [s.dtype for s in wire_specs(metas)] == ["float32", "float32"]


@pytest.mark.parametrize("cast", ["bfloat16", 16, [torch.float16]])
def test_wire_specs_rejects_a_cast_that_is_no_dtype(cast):
    with pytest.raises(ConfigError, match="cast"):
        wire_specs([TensorMeta("a", (4,), torch.float32)], cast)


def test_wire_specs_rejects_unsupported_dtypes():
    with pytest.raises(ConfigError, match="not supported"):
        wire_specs([TensorMeta("a", (4,), torch.complex128)])


# --- check_plan: every kind of corrupted plan ---------------------------------------------------

BASE_SPECS = [
    TensorSpec("a", "float32", (3,), "float32"),
    TensorSpec("b", "bfloat16", (300,), "float32"),
    TensorSpec("c", "uint8", (0,), "uint8"),
    TensorSpec("d", "int64", (5, 2), "int64"),
]
BASE = build_plan(BASE_SPECS, 256)


def _with_piece(plan: Plan, bucket: int, index: int, **changes: int) -> Plan:
    buckets = [list(b) for b in plan.buckets]
    buckets[bucket][index] = msgspec.structs.replace(buckets[bucket][index], **changes)
    return msgspec.structs.replace(plan, buckets=tuple(tuple(b) for b in buckets))


def _with_buckets(plan: Plan, buckets: list[list[Piece]]) -> Plan:
    return msgspec.structs.replace(plan, buckets=tuple(tuple(b) for b in buckets))


def _with_spec(plan: Plan, index: int, **changes: object) -> Plan:
    tensors = list(plan.tensors)
    tensors[index] = msgspec.structs.replace(tensors[index], **changes)
    return msgspec.structs.replace(plan, tensors=tuple(tensors))


def test_base_plan_is_valid():
    assert layout(BASE) == [
        [(0, 0, 0, 12), (1, 0, 64, 192)],
        [(1, 192, 0, 256)],
        [(1, 448, 0, 152), (2, 0, 192, 0)],
        [(3, 0, 0, 80)],
    ]
    check_plan(BASE, 256)
    assert reference_valid(BASE, 256)


CORRUPTIONS = {
    "bucket-above-receiver-limit": lambda: (BASE, 128),
    "bucket-size-zero": lambda: (msgspec.structs.replace(BASE, bucket_bytes=0), 256),
    "bucket-size-negative": lambda: (msgspec.structs.replace(BASE, bucket_bytes=-256), 256),
    "bucket-size-unaligned": lambda: (msgspec.structs.replace(BASE, bucket_bytes=250), 256),
    "total-bytes-lies": lambda: (msgspec.structs.replace(BASE, total_bytes=BASE.total_bytes + 1), 256),
    "duplicate-name": lambda: (_with_spec(BASE, 1, name="a"), 256),
    "empty-name": lambda: (_with_spec(BASE, 0, name=""), 256),
    "huge-name": lambda: (_with_spec(BASE, 0, name="x" * 100_000), 256),
    "unknown-dtype": lambda: (_with_spec(BASE, 0, dtype="float128"), 256),
    "pickle-dtype": lambda: (_with_spec(BASE, 0, dtype="torch.float32"), 256),
    "unknown-source-dtype": lambda: (_with_spec(BASE, 0, source_dtype="object"), 256),
    "negative-dim": lambda: (_with_spec(BASE, 0, shape=(-3,)), 256),
    "too-many-dims": lambda: (_with_spec(BASE, 2, shape=(1,) * 17 + (0,)), 256),
    "bigger-shape-than-pieces": lambda: (_with_spec(BASE, 0, shape=(4,)), 256),
    "empty-bucket": lambda: (_with_buckets(BASE, [list(BASE.buckets[0]), [], *map(list, BASE.buckets[1:])]), 256),
    "missing-last-bucket": lambda: (_with_buckets(BASE, [list(b) for b in BASE.buckets[:-1]]), 256),
    "missing-empty-tensor": lambda: (
        _with_buckets(BASE, [*map(list, BASE.buckets[:2]), [BASE.buckets[2][0]], list(BASE.buckets[3])]),
        256,
    ),
    "no-buckets": lambda: (_with_buckets(BASE, []), 256),
    "extra-piece": lambda: (
        _with_buckets(BASE, [*map(list, BASE.buckets), [Piece(3, 0, 0, 80)]]),
        256,
    ),
    "piece-of-unknown-tensor": lambda: (_with_piece(BASE, 3, 0, tensor=7), 256),
    "piece-of-negative-tensor": lambda: (_with_piece(BASE, 0, 0, tensor=-1), 256),
    "pieces-out-of-order": lambda: (
        _with_buckets(BASE, [[BASE.buckets[0][1], BASE.buckets[0][0]], *map(list, BASE.buckets[1:])]),
        256,
    ),
    "gap-in-tensor": lambda: (_with_piece(BASE, 1, 0, tensor_offset=194, nbytes=254), 256),
    "bytes-covered-twice": lambda: (_with_piece(BASE, 1, 0, tensor_offset=190, nbytes=258), 256),
    "piece-past-tensor-end": lambda: (_with_piece(BASE, 2, 0, nbytes=154), 256),
    "piece-past-bucket-end": lambda: (_with_piece(BASE, 0, 1, bucket_offset=128), 256),
    "piece-negative-bucket-offset": lambda: (_with_piece(BASE, 0, 0, bucket_offset=-64), 256),
    "pieces-overlap-in-bucket": lambda: (_with_piece(BASE, 0, 1, bucket_offset=8), 256),
    "negative-nbytes": lambda: (_with_piece(BASE, 2, 1, nbytes=-1), 256),
    "zero-piece-of-nonempty-tensor": lambda: (
        _with_buckets(BASE, [[Piece(0, 0, 0, 0), *BASE.buckets[0]], *map(list, BASE.buckets[1:])]),
        256,
    ),
    "empty-tensor-twice": lambda: (
        _with_buckets(
            BASE, [*map(list, BASE.buckets[:2]), [*BASE.buckets[2], Piece(2, 0, 192, 0)], list(BASE.buckets[3])]
        ),
        256,
    ),
    "split-element": lambda: (
        Plan(64, (TensorSpec("a", "float32", (3,), "float32"),), ((Piece(0, 0, 0, 6), Piece(0, 6, 8, 6)),), 12),
        64,
    ),
    "overflowing-empty-shape": lambda: (
        Plan(64, (TensorSpec("x", "float32", (2**62, 2**62, 0), "float32"),), ((Piece(0, 0, 0, 0),),), 0),
        64,
    ),
    "dimension-beyond-int64": lambda: (
        Plan(64, (TensorSpec("x", "float32", (2**64 - 1, 0), "float32"),), ((Piece(0, 0, 0, 0),),), 0),
        64,
    ),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_check_plan_rejects(corruption):
    plan, limit = CORRUPTIONS[corruption]()
    with pytest.raises(PlanError):
        check_plan(plan, limit)


def test_check_plan_rejects_too_many_tensors():
    count = (1 << 20) + 1
    specs = tuple(TensorSpec(str(i), "uint8", (0,), "uint8") for i in range(count))
    plan = Plan(64, specs, (), 0)
    with pytest.raises(PlanError, match="more than the limit"):
        check_plan(plan, 64)


mutation = st.tuples(
    st.integers(0, 50),  # which piece (modulo the count)
    st.sampled_from(["tensor", "tensor_offset", "bucket_offset", "nbytes"]),
    st.sampled_from([-256, -64, -8, -4, -2, -1, 1, 2, 4, 8, 64, 256]),
)


@settings(max_examples=400)
@given(specs=specs_strategy, bucket_bytes=bucket_strategy, change=mutation)
def test_check_plan_accepts_exactly_the_valid_plans(specs, bucket_bytes, change):
    """Nudge one field of one piece of a valid plan: check_plan must agree with the reference
    on whether the result is still a valid plan."""
    plan = build_plan(specs, bucket_bytes)
    flat = [(b, i) for b, bucket in enumerate(plan.buckets) for i in range(len(bucket))]
    if not flat:
        return
    which, field, delta = change
    bucket, index = flat[which % len(flat)]
    piece = plan.buckets[bucket][index]
    mutated = _with_piece(plan, bucket, index, **{field: getattr(piece, field) + delta})
    try:
        check_plan(mutated, bucket_bytes)
        accepted = True
    except PlanError:
        accepted = False
    assert accepted == reference_valid(mutated, bucket_bytes), mutated


@settings(max_examples=200)
@given(specs=specs_strategy, bucket_bytes=bucket_strategy, which=st.integers(0, 50), shift=st.integers(-300, 300))
def test_check_plan_judges_rechunked_plans_like_the_reference(specs, bucket_bytes, which, shift):
    """Move the boundary between two consecutive chunks of one tensor (the bytes stay covered):
    valid when it stays inside both buckets and on element boundaries. A receiver must accept
    any valid plan, not only the one build_plan would make."""
    plan = build_plan(specs, bucket_bytes)
    pairs = [
        (b, len(plan.buckets[b]) - 1)
        for b in range(len(plan.buckets) - 1)
        if plan.buckets[b][-1].tensor == plan.buckets[b + 1][0].tensor
    ]
    if not pairs:
        return
    bucket, index = pairs[which % len(pairs)]
    left, right = plan.buckets[bucket][index], plan.buckets[bucket + 1][0]
    mutated = _with_piece(plan, bucket, index, nbytes=left.nbytes + shift)
    mutated = _with_piece(
        mutated,
        bucket + 1,
        0,
        tensor_offset=right.tensor_offset + shift,
        nbytes=right.nbytes - shift,
    )
    try:
        check_plan(mutated, bucket_bytes)
        accepted = True
    except PlanError:
        accepted = False
    assert accepted == reference_valid(mutated, bucket_bytes), mutated


def test_tensor_nbytes():
    assert tensor_nbytes(TensorSpec("a", "bfloat16", (3, 5), "float32")) == 30
    assert tensor_nbytes(TensorSpec("a", "bool", (), "bool")) == 1
    assert tensor_nbytes(TensorSpec("a", "float64", (4, 0), "float64")) == 0
