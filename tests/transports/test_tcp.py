"""The tcp plane packs a cast bucket chunk by chunk while a thread streams what is packed: the
bytes arrive exact and in order, and a sender that fails while packing drops its links, so no
receiver commits a bucket cut short (it says it is dirty instead)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import assert_all_bit_exact, random_tensor, random_values, receiving, sending, wait_until
from weightsync.errors import SyncFailed
from weightsync.transports import tcp

MODEL = {
    "embed": random_values(torch.float32, (256, 64), seed=1),  # 64 KiB as bf16: 16 chunks of 4 KiB
    "norm": random_tensor(torch.bfloat16, (64,), seed=2),  # sent as it is: a view, no packing
    "proj": random_values(torch.float32, (3, 1000), seed=3),  # not a whole number of chunks
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(tcp, "PACK_CHUNK_BYTES", 4 << 10)


def as_sent(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.to(torch.bfloat16) for name, tensor in model.items()}


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 24 << 10])
def test_a_cast_push_streams_while_packing_and_lands_exact_on_every_receiver(bucket_bytes):
    first = {name: torch.zeros_like(t) for name, t in as_sent(MODEL).items()}
    second = {name: torch.zeros_like(t) for name, t in as_sent(MODEL).items()}
    with (
        receiving(first, "tcp") as one,
        receiving(second, "tcp") as two,
        sending([one.address, two.address], cast=torch.bfloat16, bucket_bytes=bucket_bytes) as sender,
    ):
        for version in (1, 2):
            model = {name: tensor + version for name, tensor in MODEL.items()}
            report = sender.push(model, version)
            assert report.ok and one.version == two.version == version
            assert_all_bit_exact(first, as_sent(model))
            assert_all_bit_exact(second, as_sent(model))


def test_a_sender_that_fails_while_packing_commits_nowhere_and_the_next_push_lands(monkeypatch):
    dest = {name: torch.zeros_like(t) for name, t in as_sent(MODEL).items()}
    calls = 0
    write_piece = tcp.write_piece

    def failing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 5:  # mid-bucket: four chunks of "embed" are already on the wire
            raise RuntimeError("cast failed")
        write_piece(*args, **kwargs)

    with receiving(dest, "tcp") as receiver, sending(receiver.address, cast=torch.bfloat16, timeout=5.0) as sender:
        assert sender.push(MODEL, 1).ok
        monkeypatch.setattr(tcp, "write_piece", failing)
        changed = {name: tensor + 1 for name, tensor in MODEL.items()}
        with pytest.raises(RuntimeError, match="cast failed"), contextlib.suppress(SyncFailed):
            sender.push(changed, 2)
        # the failed bucket had begun to land in the live destinations: once the receiver has
        # seen its link close (the push raised first), it says so
        assert wait_until(lambda: receiver.state != "syncing")
        assert receiver.version is None and receiver.state == "dirty"
        monkeypatch.setattr(tcp, "write_piece", write_piece)
        report = sender.push(changed, 3)
        assert report.ok and receiver.version == 3
        assert_all_bit_exact(dest, as_sent(changed))
