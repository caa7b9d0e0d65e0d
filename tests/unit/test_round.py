"""One round for every engine (weightsync.round): the one decision, and `run_round` driving a fake
window with real receivers over tcp, through the three faults every engine is tested with (a
worker that fails to land, a trainer rank that dies mid-round, a timeout) and the refusals that
change nothing. Each ends as docs/failure-semantics.md's table says: labelled, the previous
version kept, or not ready; never paused and never labelled with a version not held."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightsync import SyncFailed, TensorDictSink, WeightReceiver, WeightSender
from weightsync.errors import CollectiveError
from weightsync.report import SyncReport
from weightsync.round import SOLO, Outcome, WorkerState, decide, run_round, states_of
from weightsync.source import StateDictSource

# --- decide ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("states", "problems", "was_ready", "verdict"),
    [
        (["landed", "landed"], [], True, "label"),
        (["landed", "landed"], [], False, "label"),  # a good push recovers a not-ready engine
        (["landed", "landed"], ["the update call: boom"], True, "not-ready"),  # landed, under no label
        (["intact", "intact"], ["refused"], True, "keep"),
        (["intact", "intact"], ["refused"], False, "not-ready"),  # nothing changed: still no version
        (["landed", "intact"], ["worker 1: refused"], True, "not-ready"),  # a mix
        (["changed", "intact"], ["worker 0: boom"], True, "not-ready"),
        (["unknown", "intact"], ["no answer"], True, "not-ready"),
        (["intact"], [], True, "keep"),
        ([], [], True, "keep"),
    ],
)
def test_one_decision_for_every_round(
    states: list[WorkerState], problems: list[str], was_ready: bool, verdict: str
) -> None:
    outcome = decide(states, problems, was_ready=was_ready)
    assert outcome.verdict == verdict
    assert outcome.ready == (verdict != "not-ready")
    assert (outcome.why == "") == (verdict == "label")
    for problem in problems:
        assert problem in outcome.why


def test_a_report_tells_each_workers_state() -> None:
    from weightsync.report import ReceiverOutcome

    report = SyncReport(
        1,
        0,
        0,
        0,
        0,
        0.0,
        (
            ReceiverOutcome("a", True),
            ReceiverOutcome("b", False, "PlanError", "refused"),
            ReceiverOutcome("c", False, "TransferTimeout", "no answer"),
        ),
    )
    assert states_of(report, 3) == ["landed", "intact", "unknown"]
    assert states_of(None, 2) == ["unknown", "unknown"]


# --- run_round ---------------------------------------------------------------------------------


class Window:
    """A fake engine: whether it is paused, its label; each call recorded."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.ready = True
        self.label: str | None = "0"
        self.paused = False
        self.calls: list[str] = []
        self.update_gate: threading.Event | None = None

    def pause(self) -> None:
        self.calls.append("pause")
        self.paused = True

    def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    def start(self, version: int) -> None:
        self.calls.append("start")

    def update(self, version: int) -> None:
        if self.update_gate is not None:
            self.update_gate.wait()

    def states(self, report: SyncReport | None) -> tuple[list[WorkerState], list[str]]:
        return states_of(report, self.num_workers), []

    def finish(self, version: int, outcome: Outcome) -> None:
        self.calls.append(f"finish:{outcome.verdict}")
        self.ready = outcome.ready
        if outcome.verdict == "label":
            self.label = str(version)
        elif outcome.verdict == "not-ready":
            self.label = "not-ready"


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((64,), value), "b": torch.full((32,), value)}


class FailingSink(TensorDictSink):
    """A worker that lands into its tensors as bytes arrive, and may fail once they did."""

    fail_next = False

    def commit(self, version: int) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the model's loader failed")
        super().commit(version)


class Fleet:
    """Two workers over tcp, each landing into its own tensors; worker 1 may fail its next landing."""

    def __init__(self) -> None:
        self.held = [_weights(0.0), _weights(0.0)]
        self.second = FailingSink(self.held[1])
        sinks = [TensorDictSink(self.held[0]), self.second]
        self.receivers = [WeightReceiver(sink, "tcp", timeout=10).start() for sink in sinks]
        self.addresses = [receiver.address for receiver in self.receivers]

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


class Ranks:
    """A fake agreement of two ranks, this one leading; the other dies at the settle numbered
    `dies_at` (0: connected, 1: opened, 2: pushed)."""

    leads = True

    def __init__(self, dies_at: int | None = None) -> None:
        self.dies_at = dies_at
        self.settles = 0

    def settle(self, ok: bool) -> bool:
        index, self.settles = self.settles, self.settles + 1
        if index == self.dies_at:
            raise CollectiveError("trainer rank 0 of 2: the ranks could not agree (a rank died)")
        return ok

    def wait(self) -> None:
        return None


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    made = Fleet()
    try:
        yield made
    finally:
        made.close()


def _round(fleet: Fleet, window: Window, version: int, value: float, **more: object) -> SyncReport:
    with WeightSender(fleet.addresses, timeout=10, raise_on_failure=False) as sender:
        return run_round(sender, StateDictSource(_weights(value)), version, window, wait_s=5.0, **more)  # type: ignore[arg-type]


def _assert_never_paused_or_mislabelled(window: Window) -> None:
    """The one rule: paused only while not ready, labelled only with a version held."""
    assert window.paused == (not window.ready), window.calls
    assert (window.label == "not-ready") == (not window.ready)


def test_a_good_round_labels_and_resumes(fleet: Fleet) -> None:
    window = Window(2)
    report = _round(fleet, window, 1, 1.0)
    assert report.ok and window.label == "1"
    assert window.calls == ["pause", "start", "finish:label", "resume"]
    assert all(torch.equal(held["a"], torch.full((64,), 1.0)) for held in fleet.held)
    _assert_never_paused_or_mislabelled(window)


def test_a_worker_that_fails_to_land_leaves_the_engine_not_ready_until_a_push_lands(fleet: Fleet) -> None:
    window = Window(2)
    _round(fleet, window, 1, 1.0)
    fleet.second.fail_next = True
    with pytest.raises(SyncFailed, match="the model's loader failed.*not ready") as failed:
        _round(fleet, window, 2, 2.0)
    assert failed.value.report is not None and not failed.value.report.ok
    assert window.label == "not-ready" and window.paused and not window.ready  # worker 0 holds 2, worker 1 not
    _assert_never_paused_or_mislabelled(window)
    _round(fleet, window, 3, 3.0)  # the next good push recovers it
    assert window.label == "3" and not window.paused
    _assert_never_paused_or_mislabelled(window)


def test_a_trainer_rank_that_dies_mid_round_labels_nothing(fleet: Fleet) -> None:
    window = Window(2)
    _round(fleet, window, 1, 1.0)
    with pytest.raises(CollectiveError, match="a rank died"):
        _round(fleet, window, 2, 2.0, agreement=Ranks(dies_at=2))
    assert window.calls[-1] == "finish:not-ready" and window.label == "not-ready"  # the workers hold 2, unlabelled
    _assert_never_paused_or_mislabelled(window)
    with pytest.raises(CollectiveError):  # a rank that dies before the window opens: nothing opens
        _round(fleet, window, 3, 3.0, agreement=Ranks(dies_at=0))
    assert window.calls[-1] == "finish:not-ready"
    _round(fleet, window, 4, 4.0, agreement=Ranks())
    assert window.label == "4"
    _assert_never_paused_or_mislabelled(window)


def test_a_trainer_rank_that_dies_as_the_window_opens_ends_it_and_changes_nothing(fleet: Fleet) -> None:
    window = Window(2)
    _round(fleet, window, 1, 1.0)
    with pytest.raises(CollectiveError, match="a rank died"):
        _round(fleet, window, 2, 2.0, agreement=Ranks(dies_at=1))
    assert window.calls[-3:] == ["start", "finish:keep", "resume"] and window.label == "1"
    assert torch.equal(fleet.held[1]["a"], torch.full((64,), 1.0))
    _assert_never_paused_or_mislabelled(window)


def test_a_timeout_of_the_update_call_ends_the_round_promptly_and_labels_nothing(fleet: Fleet) -> None:
    window = Window(2)
    window.update_gate = threading.Event()  # the engine's update call never answers
    started = time.monotonic()
    try:
        with WeightSender(fleet.addresses, timeout=10, raise_on_failure=False) as sender:
            with pytest.raises(SyncFailed, match="the update call: no answer within 0.5 s"):
                run_round(sender, StateDictSource(_weights(1.0)), 1, window, wait_s=0.5)
    finally:
        window.update_gate.set()
    assert time.monotonic() - started < 5, "the round joined the update call's thread"
    assert window.label == "not-ready"  # every worker landed 1, but the engine never said so
    _assert_never_paused_or_mislabelled(window)


def test_a_refused_plan_keeps_the_previous_version_serving(fleet: Fleet) -> None:
    window = Window(2)
    _round(fleet, window, 1, 1.0)
    with WeightSender(fleet.addresses, timeout=10, raise_on_failure=False) as sender:
        lacking = StateDictSource({"a": torch.full((64,), 2.0)})
        with pytest.raises(SyncFailed, match="plan lacks.*previous weights serve"):
            run_round(sender, lacking, 2, window, wait_s=5.0)
    assert window.label == "1" and window.calls[-2:] == ["finish:keep", "resume"]
    assert torch.equal(fleet.held[0]["a"], torch.full((64,), 1.0))
    _assert_never_paused_or_mislabelled(window)


def test_a_refused_sender_opens_nothing(fleet: Fleet) -> None:
    window = Window(2)
    with WeightSender(fleet.addresses, timeout=10, raise_on_failure=False, auth_token="t" * 32) as sender:
        with pytest.raises(SyncFailed, match="AuthError.*previous weights serve") as failed:
            run_round(sender, StateDictSource(_weights(1.0)), 1, window, wait_s=5.0)
    assert window.calls == [] and window.label == "0"
    assert failed.value.report is not None and len(failed.value.report.failed) == 2


def test_a_source_that_cannot_say_what_it_holds_opens_nothing(fleet: Fleet) -> None:
    class Unreadable(StateDictSource):
        def metas(self):  # type: ignore[no-untyped-def]
            raise ValueError("unreadable index")

    window = Window(2)
    with WeightSender(fleet.addresses, timeout=10, raise_on_failure=False) as sender:
        with pytest.raises(ValueError, match="unreadable index"):
            run_round(sender, Unreadable(_weights(1.0)), 1, window, agreement=SOLO, wait_s=5.0)
    assert window.calls == []
