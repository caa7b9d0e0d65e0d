"""The native delta diff (deltadiff.c) must agree bit for bit with numpy's, at every size, split
over threads or not, for every bit pattern (NaN payloads, -0.0), and cast fp32 to bf16 exactly as
torch does."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from weightsync import delta
from weightsync.patch import crc_room, joined_crc
from weightsync.plan import wire_specs
from weightsync.source import as_source

native = pytest.importorskip("weightsync._native.deltadiff", reason="native diff not built")

PER_THREAD = 1 << 18  # deltadiff.c's MIN_PER_THREAD: below twice this, one thread runs
BITS = {2: np.uint16, 4: np.uint32}

# Sizes around every edge: the 64-element blocks, their tails, and the split over threads.
edge_sizes = st.sampled_from(
    [0, 1, 15, 63, 64, 65, 127, 129, 2 * PER_THREAD - 1, 2 * PER_THREAD + 77, 3 * PER_THREAD + 5]
)


@pytest.fixture(params=["avx2", "portable"], autouse=True)
def loops(request):  # type: ignore[no-untyped-def]
    """Every test runs with the AVX2 loops (where the CPU has them) and with the portable ones."""
    if request.param == "avx2" and not native.AVX2:
        pytest.skip("this CPU has no AVX2")
    previous = native.portable(request.param == "portable")
    yield
    native.portable(previous)


def reference(new: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    where = np.flatnonzero(new != base)
    return where, new[where]


def outputs(numel: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(numel, -1, dtype=np.int32), np.zeros(numel * itemsize, dtype=np.uint8)


def check_diff(new: np.ndarray, base: np.ndarray, threads: int) -> None:
    itemsize = new.dtype.itemsize
    where, values = reference(new, base)
    indices, out = outputs(new.size, itemsize)
    crcs = crc_room()
    count = native.diff(new, base, itemsize, indices, out, threads, crcs)
    assert count == where.size
    assert np.array_equal(indices[:count], where)
    assert np.array_equal(out[: count * itemsize].view(new.dtype), values)
    assert np.array_equal(base, new)  # the baseline now holds the new version
    assert joined_crc(crcs) == crc32c.crc32c(new.tobytes())  # and the pass hashed it


@settings(max_examples=80, deadline=None)
@given(
    itemsize=st.sampled_from([2, 4]),
    numel=edge_sizes | st.integers(0, 4096),
    fraction=st.sampled_from([0.0, 0.001, 0.03, 0.5, 1.0]),
    threads=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_diff_matches_numpy_at_any_size_and_split(
    itemsize: int, numel: int, fraction: float, threads: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    bits = BITS[itemsize]
    base = rng.integers(0, np.iinfo(bits).max, numel, dtype=bits, endpoint=True)
    new = base.copy()
    changed = rng.random(numel) < fraction
    new[changed] ^= rng.integers(1, np.iinfo(bits).max, int(changed.sum()), dtype=bits, endpoint=True)
    check_diff(new, base, threads)


@settings(max_examples=80, deadline=None)
@given(
    pair=st.integers(0, 300).flatmap(
        lambda n: st.tuples(
            hnp.arrays(np.uint16, n, elements=st.sampled_from([0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC0, 0xFFFF, 0x7F80]))
            | hnp.arrays(np.uint16, n),
            hnp.arrays(np.uint16, n, elements=st.sampled_from([0x0000, 0x8000, 0x7FC0, 0x7FC1, 0xFFC0, 0xFFFF, 0x7F80]))
            | hnp.arrays(np.uint16, n),
        )
    )
)
def test_nan_payloads_and_negative_zero_count_by_their_bits(pair: tuple[np.ndarray, np.ndarray]) -> None:
    new, base = pair
    check_diff(new, base.copy(), threads=2)


# Every class of float32: zeros of both signs, denormals, ties for the rounding, infinities, NaNs
# with any payload and sign, and anything at all.
special_f32 = st.sampled_from(
    [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F8000]
    + [0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF, 0x7FFF8000, 0xFF800001]
)


@settings(max_examples=80, deadline=None)
@given(
    src=st.integers(0, 400).flatmap(
        lambda n: hnp.arrays(np.uint32, n, elements=special_f32) | hnp.arrays(np.uint32, n)
    ),
    base_seed=st.integers(0, 2**32 - 1),
    threads=st.integers(1, 3),
)
def test_cast_diff_rounds_exactly_as_torch(src: np.ndarray, base_seed: int, threads: int) -> None:
    expected = (
        torch.from_numpy(src.view(np.float32).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    )
    rng = np.random.default_rng(base_seed)
    base = np.where(rng.random(src.size) < 0.5, expected, rng.integers(0, 1 << 16, src.size, dtype=np.uint16))
    where, values = reference(expected, base)
    indices, out = outputs(src.size, 2)
    crcs = crc_room()
    count = native.cast_diff(src.view(np.float32), base, indices, out, threads, crcs)
    assert joined_crc(crcs) == crc32c.crc32c(expected.tobytes())
    assert count == where.size
    assert np.array_equal(indices[:count], where)
    assert np.array_equal(out[: count * 2].view(np.uint16), values)
    assert np.array_equal(base, expected)


def test_cast_diff_splits_a_large_tensor_exactly() -> None:
    src = (torch.randn(3 * PER_THREAD + 11, generator=torch.Generator().manual_seed(3)) * 0.02).numpy()
    expected = torch.from_numpy(src).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    base = expected.copy()
    base[::97] ^= 1
    where, values = reference(expected, base)
    indices, out = outputs(src.size, 2)
    crcs = crc_room()
    count = native.cast_diff(src, base, indices, out, 4, crcs)
    assert np.array_equal(indices[:count], where) and np.array_equal(out[: count * 2].view(np.uint16), values)
    assert np.array_equal(base, expected)
    assert joined_crc(crcs) == crc32c.crc32c(expected.tobytes())


def test_bad_arguments_are_refused() -> None:
    new, base = np.zeros(64, np.uint16), np.zeros(64, np.uint16)
    with pytest.raises(ValueError, match="room"):
        native.diff(new, base, 2, np.empty(63, np.int32), np.empty(128, np.uint8), 1)
    with pytest.raises(ValueError, match="itemsize"):
        native.diff(new, base, 8, *outputs(64, 8), 1)
    with pytest.raises(ValueError, match="itemsize"):
        native.diff(new, np.zeros(63, np.uint16), 2, *outputs(64, 2), 1)
    with pytest.raises(ValueError, match="float32"):
        native.cast_diff(np.zeros(64, np.float32), np.zeros(65, np.uint16), *outputs(65, 2), 1)
    read_only = np.zeros(64, np.uint16)
    read_only.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        native.diff(new, read_only, 2, *outputs(64, 2), 1)


class Steps:
    """A few tensors of several dtypes, as the sender sees them, stepped by a small amount."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.state = {
            "fp32_cast": torch.randn(70_001, generator=gen) * 0.02,  # cast to bf16 in the same pass
            "bf16": (torch.randn(5_003, generator=gen) * 0.02).to(torch.bfloat16),
            "fp32_kept": torch.randn(3_001, generator=gen),
            "int64": torch.arange(999),  # 8 bytes: numpy's path either way
            "noncontig": (torch.randn(64, 80, generator=gen) * 0.02).t(),
        }

    def step(self, fraction: float) -> None:
        for t in self.state.values():
            mask = torch.rand(t.shape, generator=self.gen) < fraction
            if t.is_floating_point():
                t.add_(torch.where(mask, torch.randn(t.shape, generator=self.gen), 0).to(t.dtype))
            else:
                t.add_(mask.to(t.dtype))


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.2, 0.9])
def test_baseline_diffs_natively_exactly_as_with_numpy(monkeypatch, fraction: float) -> None:
    steps = Steps(seed=11)
    cast = {"fp32_cast": torch.bfloat16, "noncontig": torch.bfloat16}
    specs = wire_specs(as_source(steps.state).metas(), cast)
    with_native, with_numpy = delta.Baseline(), delta.Baseline()

    def both(state: dict[str, torch.Tensor]) -> tuple[delta.Diff, delta.Diff]:
        first = with_native.diff(specs, as_source(state))
        monkeypatch.setattr(delta, "NATIVE", None)
        try:
            return first, with_numpy.diff(specs, as_source(state))
        finally:
            monkeypatch.setattr(delta, "NATIVE", native)

    both(steps.state)
    for _ in range(3):
        steps.step(fraction)
        ours, theirs = both(steps.state)
        assert ours.specs == theirs.specs and ours.content == theirs.content and ours.base == theirs.base
        assert ours.changed_elements == theirs.changed_elements
        for a, b in zip(ours.payloads, theirs.payloads, strict=True):
            assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
        assert (ours.changed_elements > 0) == (fraction > 0)


@settings(max_examples=40, deadline=None)
@given(
    itemsize=st.sampled_from([2, 4]),
    numel=st.integers(1, 5000) | st.sampled_from([PER_THREAD // 4 + 3, PER_THREAD]),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_apply_writes_exactly_the_named_elements(itemsize: int, numel: int, threads: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    bits = BITS[itemsize]
    dest = rng.integers(0, np.iinfo(bits).max, numel, dtype=bits, endpoint=True)
    where = np.sort(rng.choice(numel, rng.integers(0, numel + 1), replace=False)).astype(np.int32)
    values = rng.integers(0, np.iinfo(bits).max, where.size, dtype=bits, endpoint=True)
    expected = dest.copy()
    expected[where] = values
    native.apply(dest, itemsize, where, values, threads)
    assert np.array_equal(dest, expected)


def test_apply_refuses_an_index_outside_and_writes_nothing() -> None:
    dest = np.zeros(8, np.uint16)
    with pytest.raises(IndexError, match="outside"):
        native.apply(dest, 2, np.array([1, 8], np.int32), np.array([5, 6], np.uint16), 2)
    with pytest.raises(IndexError, match="outside"):
        native.apply(dest, 2, np.array([2, -1], np.int32), np.array([5, 6], np.uint16), 2)
    assert not dest.any()
    with pytest.raises(ValueError, match="one value each"):
        native.apply(dest, 2, np.array([1, 2], np.int32), np.array([5], np.uint16), 1)


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from([2, 4]),
    numel=st.integers(1, 3000) | st.sampled_from([255, 256, 257, 4 * PER_THREAD + 300]),
    fraction=st.sampled_from([0.0, 0.03, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_blocks_patch_writes_exactly_its_elements_natively_and_with_numpy(
    itemsize: int, numel: int, fraction: float, seed: int
) -> None:
    from unittest import mock

    from weightsync import patch
    from weightsync.messages import TensorSpec

    rng = np.random.default_rng(seed)
    bits = BITS[itemsize]
    dest = rng.integers(0, np.iinfo(bits).max, numel, dtype=bits, endpoint=True)
    where = np.flatnonzero(rng.random(numel) < fraction).astype(np.int32)
    values = rng.integers(0, np.iinfo(bits).max, where.size, dtype=bits, endpoint=True)
    expected = dest.copy()
    expected[where] = values
    dtype = "bfloat16" if itemsize == 2 else "float32"
    spec = TensorSpec("w", dtype, (numel,), dtype, "dense")
    encoded = {}
    for built in (native, None):  # the native encoder and decoder, then numpy's
        with mock.patch.object(patch, "NATIVE", built), mock.patch.object(patch, "_cheapest", lambda *a: "blocks"):
            patched, payload = patch.encode(where, values.view(np.uint8), numel, spec, lambda n: np.empty(n, np.uint8))
            assert patched.encoding == "blocks" and patched.count == where.size and payload is not None
            encoded[built] = payload
            out = torch.from_numpy(dest.copy()).view(torch.bfloat16 if itemsize == 2 else torch.float32)
            crc = patch.apply_patch(out, patched, torch.from_numpy(payload))
            # the native apply hashes the destination it leaves (where there was a change to apply)
            assert crc == (crc32c.crc32c(expected.tobytes()) if built is not None and where.size else None)
        assert np.array_equal(out.view(torch.int16 if itemsize == 2 else torch.int32).numpy().view(bits), expected)
    assert np.array_equal(encoded[native], encoded[None])


@pytest.mark.parametrize("path", ["native", "numpy"])
def test_a_hostile_blocks_patch_is_refused_and_writes_nothing(monkeypatch, path: str) -> None:
    from weightsync import patch
    from weightsync.errors import PlanError
    from weightsync.messages import TensorSpec

    monkeypatch.setattr(patch, "NATIVE", native if path == "native" else None)
    spec = TensorSpec("w", "bfloat16", (300,), "bfloat16", "blocks", 2)  # two blocks: 256 + 44 elements

    def payload(counts: list[int], offsets: list[int]) -> torch.Tensor:
        raw = np.array([7, 9], np.uint16).tobytes() + np.array(counts, np.uint16).tobytes() + bytes(offsets)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    dest = torch.zeros(300, dtype=torch.bfloat16)
    for counts, offsets in [
        ([0, 2], [10, 44]),  # element 256 + 44 = 300: past the end
        ([1, 0], [10, 11]),  # counts add up to 1, the plan says 2
        ([3, 0], [10, 11]),  # counts add up to 3
    ]:
        with pytest.raises(PlanError):
            patch.apply_patch(dest, spec, payload(counts, offsets))
    assert not dest.view(torch.int16).any()
    patch.apply_patch(dest, spec, payload([1, 1], [10, 43]))
    assert dest.view(torch.int16)[[10, 299]].tolist() == [7, 9] and dest.view(torch.int16).count_nonzero() == 2


def test_whole_model_digests_on_threads_equal_one_by_one() -> None:
    from weightsync.checksum import piece_hashes, tensor_hashes

    rng = np.random.default_rng(5)
    views = [rng.integers(0, 256, size, dtype=np.uint8) for size in (0, 1, 4097, 1 << 20, 3, 1 << 16)]
    assert tensor_hashes(views) == piece_hashes(views) == [crc32c.crc32c(v.tobytes()) for v in views]
