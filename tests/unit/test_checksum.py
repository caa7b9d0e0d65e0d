"""The hashes behind verification and the content digest: CRC32C composes, so the shares of a
tensor's parts, hashed apart (by the trainer ranks of a sharded push), give the hash of the
whole tensor, and every rank's shares give the digest of the version pushed whole."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import RowShards, random_tensor
from weightsync.checksum import combine_shares, share, tensor_hash
from weightsync.digest import held_shares, source_digest
from weightsync.errors import ChecksumError, PlanError
from weightsync.messages import TensorShare
from weightsync.source import SourceLayout


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=5))
def test_the_shares_of_any_split_xor_to_the_hash_of_the_whole(data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(cut, len(data)) for cut in cuts), len(data)]
    shares = [
        share(crc32c.crc32c(data[start:stop]), len(data) - stop)
        for start, stop in zip(bounds, bounds[1:], strict=False)
    ]
    combined = 0
    for part in shares:
        combined ^= part
    assert combined == crc32c.crc32c(data) == tensor_hash(np.frombuffer(data, np.uint8))


def test_a_shift_past_many_gigabytes_is_exact() -> None:
    # a zero-filled tail leaves the CRC's register to the shift alone: 5 GiB of zeros
    head = b"weights"
    running = crc32c.crc32c(head)
    for _ in range(5):
        running = crc32c.crc32c(bytes(1 << 30), running)
    assert share(crc32c.crc32c(head), 5 << 30) ^ share(crc32c.crc32c(bytes(5 << 30)), 0) == running


def test_a_tensor_hashed_in_pieces_runs_to_the_hash_of_its_bytes() -> None:
    view = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    running = 0
    for start in range(0, view.size, 777):
        running = tensor_hash(view[start : start + 777], running)
    assert running == tensor_hash(view)


def model() -> dict[str, torch.Tensor]:
    return {
        "embed": random_tensor(torch.float32, (11, 8), 0),
        "norm": random_tensor(torch.float32, (8,), 1),
        "experts": random_tensor(torch.bfloat16, (3, 5, 4), 2),
        "bias": random_tensor(torch.float16, (1, 5), 3),  # fewer rows than ranks: some hold none
        "empty": torch.empty(0, 4),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_every_ranks_shares_give_the_digest_of_the_version_pushed_whole(world: int, cast: torch.dtype | None) -> None:
    full = model()
    shares = [
        held_shares(RowShards(full, rank, world), RowShards(full, rank, world).layout(), cast) for rank in range(world)
    ]
    assert combine_shares(shares) == source_digest(full, cast)


def test_shares_of_other_weights_give_another_digest() -> None:
    full = model()
    shares = [held_shares(RowShards(full, rank, 2), RowShards(full, rank, 2).layout()) for rank in range(2)]
    changed = dict(full, embed=full["embed"].clone())
    changed["embed"][10, 7] = 0.5 if full["embed"][10, 7] != 0.5 else 0.25  # the last element: rank 1's rows
    other = held_shares(RowShards(changed, 1, 2), RowShards(changed, 1, 2).layout())
    assert combine_shares([shares[0], other]) == source_digest(changed) != source_digest(full)


def test_parts_that_hashed_different_tensors_fail() -> None:
    one = (TensorShare("a", "float32", (2,), 5),)
    with pytest.raises(ChecksumError, match="parts 0 and 1 hashed different tensors"):
        combine_shares([one, (TensorShare("b", "float32", (2,), 5),)])


def test_a_rank_that_holds_other_rows_than_its_layout_says_fails() -> None:
    full = {"embed": random_tensor(torch.float32, (4, 2), 0)}
    layout = SourceLayout.from_rows(0, 2, ((0, 3, 4),))  # says rows [0, 3); Rows holds torch.chunk's [0, 2)
    with pytest.raises(PlanError, match=r"not rows \[0, 3\)"):
        held_shares(RowShards(full, 0, 2), layout)
