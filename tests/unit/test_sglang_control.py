"""The SGLang backend's control messages and landings, without SGLang: what the trainer writes
into SGLang's update call decodes in a worker as exactly the message sent, anything else is
refused, each worker's `LandResult` travels back through the trainer's store, and the trainer
takes no version at or below its last label unless told."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from weightsync.errors import ProtocolError, TransferTimeout
from weightsync.integrations.sglang.control import (
    CONTROL_NAME,
    Land,
    LandResult,
    connect_store,
    decode,
    payload,
    read_results,
    write_result,
)
from weightsync.workers.rendezvous import open_store
from weightsync.workers.start import Start


def _as_sglang_reads(entry: str) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's worker gets from one rank's entry (base64, then its restricted unpickler,
    which allows a plain CPU tensor: this is plain pickle's view of the same bytes)."""
    return pickle.loads(base64.b64decode(entry))  # noqa: S301  (the test's own bytes)


@pytest.mark.parametrize(
    "message",
    [
        Start(
            rendezvous="127.0.0.1:1234", session="ab12", transport="tcp", receiver={"port": 5000, "verify": "bucket"}
        ),
        Land(version=7, session="ab12", timeout=30.0),
    ],
)
def test_a_control_message_decodes_as_sent_on_every_rank(message: Start | Land) -> None:
    entries = payload(message, num_ranks=2)
    assert len(entries) == 2
    for entry in entries:
        named = _as_sglang_reads(entry)
        assert [name for name, _ in named] == [CONTROL_NAME]
        assert decode(named) == message
    assert len(entries[0]) < 2048  # a control message, never weights


@pytest.mark.parametrize(
    "named",
    [
        [("model.norm.weight", torch.zeros(4))],
        [(CONTROL_NAME, torch.zeros(4))],
        [(CONTROL_NAME, torch.frombuffer(bytearray(b'{"type": "other"}'), dtype=torch.uint8))],
        [(CONTROL_NAME, torch.zeros(2, 2, dtype=torch.uint8))],
        [],
    ],
    ids=["weights", "float", "unknown-tag", "2-d", "empty"],
)
def test_anything_but_one_control_message_is_refused(named: list[tuple[str, torch.Tensor]]) -> None:
    with pytest.raises(ProtocolError):
        decode(named)


def test_landings_travel_back_through_the_store() -> None:
    store, where = open_store("127.0.0.1", 10)
    worker = connect_store(where, 10)
    write_result(worker, "s1", LandResult(rank=1, version=3, landed=False, touched=True, error="boom"))
    write_result(worker, "s1", LandResult(rank=0, version=3, landed=True, touched=True))
    landings = read_results(store, "s1", 3, [0, 1], timeout=10)
    assert [(landing.rank, landing.landed, landing.touched) for landing in landings] == [
        (0, True, True),
        (1, False, True),
    ]
    with pytest.raises(TransferTimeout):
        read_results(store, "s1", 3, [0, 1], timeout=0.2)  # read once: a version's landings are consumed
    store.set("s1/landing/4/0", '{"rank": 1, "version": 4, "landed": true, "touched": true}')
    with pytest.raises(ProtocolError, match="rank 1"):
        read_results(store, "s1", 4, [0], timeout=10)


def test_sglangs_window_reads_each_workers_result_and_says_not_ready_by_its_label() -> None:
    """`SGLangWindow` (the one rule on SGLang): a worker whose result says it landed is landed,
    one that touched the model and failed is changed, one that did not is intact; not ready is the weight version `not-ready` (generation stays paused)."""
    from types import SimpleNamespace

    from weightsync.integrations.sglang.trainer import SGLangWindow
    from weightsync.round import NOT_READY, Outcome

    class Client:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __getattr__(self, name: str) -> object:
            return lambda *args, **kwargs: self.calls.append(f"{name}{list(args)}")

        def weight_version(self) -> str:
            return "7"

    store, where = open_store("127.0.0.1", 10)
    worker = connect_store(where, 10)
    client = Client()
    workers = [SimpleNamespace(rank=0), SimpleNamespace(rank=1), SimpleNamespace(rank=2)]
    engine = SimpleNamespace(client=client, _store=store, _session="s1", workers=workers, deadline=5.0)
    engine._check_label = lambda version: None
    window = SGLangWindow(engine, True)  # type: ignore[arg-type]
    window.start(7)
    write_result(worker, "s1", LandResult(rank=0, version=7, landed=True, touched=True))
    write_result(worker, "s1", LandResult(rank=1, version=7, landed=False, touched=True, error="load failed"))
    write_result(worker, "s1", LandResult(rank=2, version=7, landed=False, touched=False, error="timed out"))
    states, why = window.states(None)
    assert states == ["landed", "changed", "intact"]
    assert why == ["TP rank 1: load failed", "TP rank 2: timed out"]
    window.finish(7, Outcome("not-ready", "a mix"))
    assert client.calls[-1] == f"label[{NOT_READY!r}]" and not window.ready
    window.finish(8, Outcome("label"))
    assert client.calls[-1] == "label['8']" and window.ready


def test_the_trainer_takes_no_version_at_or_below_its_last_label_unless_allowed() -> None:
    from weightsync.errors import ConfigError, WeightSyncError
    from weightsync.integrations.sglang.trainer import SGLangEngine
    from weightsync.options import SenderOptions

    weights = {"w": torch.zeros(1)}
    with SGLangEngine("http://127.0.0.1:9") as engine:
        engine.version = 5
        with pytest.raises(ConfigError, match=r"above the last one labelled \(5\), got 5"):
            engine.push(weights, 5)
    with SGLangEngine("http://127.0.0.1:9", options=SenderOptions(allow_older_version=True)) as engine:
        engine.version = 5
        with pytest.raises(WeightSyncError) as raised:  # past the check: it connects to SGLang, which is not there
            engine.push(weights, 3)
        assert not isinstance(raised.value, ConfigError), raised.value
