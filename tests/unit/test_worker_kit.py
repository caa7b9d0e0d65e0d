"""The worker kit's start message and receiver stack, the same for every engine's workers: what a
`Start` carries (never the token), the options each worker builds from it, and a worker's
receiver announced in the rendezvous store."""

from __future__ import annotations

import os

import pytest
import torch

from weightsync import TensorDictSink, WeightSender
from weightsync.auth import TOKEN_ENV
from weightsync.errors import ConfigError, ProtocolError
from weightsync.options import ReceiverOptions
from weightsync.workers.rendezvous import Rendezvous
from weightsync.workers.start import Start, start_receiver, token_inherited


def test_a_start_message_carries_every_receiver_option_but_the_token() -> None:
    options = ReceiverOptions(host="127.0.0.1", port=7000, timeout=12.0, verify="bucket", auth_token="t" * 32)
    start = Start(rendezvous="127.0.0.1:1", session="s", transport="tcp", receiver=options.without_token())
    assert "t" * 32 not in str(start.to_json())
    assert Start.from_json(start.to_json()) == start
    with pytest.raises(ConfigError, match="no token"):
        Start(rendezvous="127.0.0.1:1", session="s", receiver={"auth_token": "t" * 32})
    with pytest.raises(ProtocolError):
        Start.from_json({"type": "start", "session": "s"})


def test_each_worker_takes_its_port_and_its_token_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "w" * 32)
    start = Start(rendezvous="127.0.0.1:1", session="s", receiver={"port": 7000, "timeout": 5.0})
    assert [start.options(rank).port for rank in (0, 3)] == [7000, 7003]
    assert start.options(1).auth_token == "w" * 32 and start.options(1).timeout == 5.0
    assert Start(rendezvous="127.0.0.1:1", session="s").options(2).port == 0  # any free port, every rank
    with pytest.raises(ConfigError, match="unknown option"):
        Start(rendezvous="127.0.0.1:1", session="s", receiver={"prot": 1}).options(0)


def test_the_token_reaches_the_engines_processes_only_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with token_inherited("k" * 32):
        assert os.environ[TOKEN_ENV] == "k" * 32
    assert TOKEN_ENV not in os.environ
    monkeypatch.setenv(TOKEN_ENV, "o" * 32)
    with token_inherited("k" * 32):
        assert os.environ[TOKEN_ENV] == "k" * 32
    assert os.environ[TOKEN_ENV] == "o" * 32
    with token_inherited(None):
        assert os.environ[TOKEN_ENV] == "o" * 32


def test_a_workers_receiver_is_announced_and_takes_a_push(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    landed = {"w": torch.zeros(6)}
    with Rendezvous("127.0.0.1", 10) as rendezvous:
        start = Start(rendezvous=rendezvous.where, session=rendezvous.session, transport="tcp")
        receiver = start_receiver(start, TensorDictSink(landed), rank=2, weight_bytes=24)
        try:
            (worker,) = rendezvous.collect()
            assert (worker.address, worker.rank, worker.weight_bytes) == (receiver.address, 2, 24)
            with WeightSender([worker.address]) as sender:
                sender.push(weights, version=1)
            assert torch.equal(landed["w"], weights["w"]) and receiver.status.version == 1
        finally:
            receiver.close()
