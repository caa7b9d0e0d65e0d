"""One weight-update round for any engine, and the one rule for how it ends (`decide`).

A trainer that drives an engine's update window itself (vLLM's trainer API, SGLang) runs
`run_round`; the server's own control (serving/control.py) runs the same phases on its event
loop and ends them with the same `decide`. Every phase at its call site::

    sender.connect()                     a worker that refuses the sender: nothing opens
    agreement.settle(connected)          every trainer rank connected (or none goes on)
    source.metas()                       a source that cannot say what it holds: nothing opens
    window.pause()                       (a `Pausing` window) generation pauses
    window.start(version)                the engine's update window opens
    window.update(version)  ||           every worker lands the version as it arrives
    sender.push(source, version)         one push to every worker
    window.states(report)                how each worker's weights fared
    agreement.settle(ok)                 did every rank's part commit?
    decide(states, problems)             label, keep or not-ready
    window.finish(version, outcome)      the window ends; the engine shows the outcome
    window.resume()                      (a `Pausing` window, unless not-ready)

The rule (docs/failure-semantics.md), for every engine: a version is labelled only when every
worker landed it and nothing went wrong; when no worker's weights changed, the previous version
serves on, labelled as before; otherwise (some worker's weights changed, or nobody knows) the
engine says it is not ready and serves nothing until a push lands, and it is never labelled with
a version it does not hold. A worker that refused the push (its plan, or a version at or below the
last it committed: versions only go forward) is intact.

Every wait is bounded (the update call by `wait_s`, each agreement by its own timeout), and a
control-plane thread is never joined on the error path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol, runtime_checkable

from weightsync.errors import CollectiveError, RemoteError, SyncFailed, WeightSyncError, one_line
from weightsync.report import ReceiverOutcome, SyncReport
from weightsync.sender import WeightSender
from weightsync.source import WeightSource

__all__ = [
    "NOT_READY",
    "SOLO",
    "Agreement",
    "Outcome",
    "Pausing",
    "Solo",
    "UpdateWindow",
    "Verdict",
    "WorkerState",
    "decide",
    "not_pushed",
    "run_round",
    "states_of",
]

NOT_READY = "not-ready"
"""The weight version an engine reports while its weights are no version (a not-ready round)."""

Verdict = Literal["label", "keep", "not-ready"]
"""How a round ends: `label` the version; `keep` the previous one serving; `not-ready`."""

WorkerState = Literal["landed", "intact", "changed", "unknown"]
"""One worker's weights after a round: it `landed` the version whole; they are `intact` (nothing
of the round reached them); they `changed` part way; or nobody knows (`unknown`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What a round decided, and why (empty when labelled)."""

    verdict: Verdict
    why: str = ""

    @property
    def ready(self) -> bool:
        """The engine serves an intact version afterwards (the new one, or the previous one)."""
        return self.verdict != "not-ready"


def decide(states: Sequence[WorkerState], problems: Sequence[str] = (), *, was_ready: bool = True) -> Outcome:
    """The one decision of a round (module docstring).

    Args:
        states: each worker's weights after the round.
        problems: what else went wrong (an engine call that failed, another rank's part, a
            timeout); any problem refuses the label.
        was_ready: the engine served an intact version before the round (False: a previous
            round left it not ready, and a round that changes nothing does not make it ready).
    """
    why = "; ".join(problem for problem in problems if problem)
    if states and not why and all(state == "landed" for state in states):
        return Outcome("label")
    if not why:
        unfinished = [rank for rank, state in enumerate(states) if state != "landed"]
        why = f"worker(s) {unfinished} did not land the version" if unfinished else "no worker took the version"
    if all(state == "intact" for state in states):
        return Outcome("keep" if was_ready else "not-ready", why)
    return Outcome("not-ready", why)


def states_of(report: SyncReport | None, num_workers: int) -> list[WorkerState]:
    """Each worker's state as a sender's report tells it, for a worker that lands a push as it
    arrives: committed is landed, refused is intact (refused before any byte), anything else
    (and every worker when the push raised: `report` None) unknown."""
    if report is None:
        return ["unknown"] * num_workers
    return [_state(outcome) for outcome in report.outcomes]


def _state(outcome: ReceiverOutcome) -> WorkerState:
    if outcome.committed:
        return "landed"
    return "intact" if outcome.refused else "unknown"


class UpdateWindow(Protocol):
    """An engine's update window, as one round drives it (on the leading rank only)."""

    @property
    def ready(self) -> bool:
        """The engine serves an intact version now (False: a round left it not ready)."""

    def start(self, version: int) -> None:
        """Open the window on every worker."""

    def update(self, version: int) -> None:
        """Run on a thread beside the push: returns once every worker's landing of `version`
        ended (bounded by the workers' own timeouts)."""

    def states(self, report: SyncReport | None) -> tuple[list[WorkerState], list[str]]:
        """Each worker's weights after the push (`report` None: the push raised), and what went
        wrong on the workers that the report does not say."""

    def finish(self, version: int, outcome: Outcome) -> None:
        """End the window: label `version` (`label`), keep the previous label (`keep`), or
        make the engine say it is not ready and serve nothing (`not-ready`)."""


@runtime_checkable
class Pausing(Protocol):
    """A window whose engine pauses generation for the whole round."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Agreement(Protocol):
    """The trainer ranks of one round: one rank (`Solo`), or every rank of a sharded push."""

    @property
    def leads(self) -> bool:
        """This rank drives the engine's window."""

    def settle(self, ok: bool) -> bool:
        """Whether every rank says `ok` (raises `CollectiveError` when a rank is gone)."""

    def wait(self) -> None:
        """Until every rank got here."""


class Solo:
    """The agreement of one rank."""

    leads = True

    def settle(self, ok: bool) -> bool:
        return ok

    def wait(self) -> None:
        return None


SOLO = Solo()


def run_round(
    sender: WeightSender,
    source: WeightSource,
    version: int,
    window: UpdateWindow,
    agreement: Agreement = SOLO,
    *,
    wait_s: float,
    deadline: float | None = None,
    walk_unpushed: bool = False,
) -> SyncReport:
    """One round (module docstring): `source` pushed as `version` and decided on every rank.

    Args:
        wait_s: seconds the update call may take once the push ended.
        deadline: seconds the push itself may take (None: its timeouts bound each wait).
        walk_unpushed: a round that pushes nothing still walks the source (processes outside
            the agreement walk it too, and materialising a tensor may be a collective).

    Returns:
        The push's report, once the version is labelled.

    Raises:
        SyncFailed: not labelled; the message says whether the previous version serves or the
            engine is not ready, and why.
        CollectiveError: another rank died or fell behind; the window was decided all the same.
        Whatever the source's index raised (nothing was opened).
    """
    lead = agreement.leads
    _connect(sender, source, version, agreement, walk_unpushed)
    if lead and isinstance(window, Pausing):
        window.pause()
    opened = _raised(window.start, version) if lead else None
    try:
        together = agreement.settle(opened is None)
    except CollectiveError as exc:  # a rank is gone before any push: the window ends, nothing changed
        _end(window, version, decide(["intact"], [one_line(exc)], was_ready=window.ready), lead)
        raise
    if not together:
        why = (
            f"the update window did not open: {one_line(opened)}"
            if opened
            else "the leading rank's window did not open"
        )
        outcome = decide(["intact"], [why], was_ready=window.ready) if lead else Outcome("keep", why)
        outcome = _end(window, version, outcome, lead)
        raise _unlabelled(version, outcome, not_pushed(version, sender.addresses, {}), lead)
    report, problems = _push_beside(sender, source, version, window if lead else None, wait_s, deadline)
    states, found = window.states(report) if lead else ([], [])
    problems += found
    mine = not problems and report is not None and report.ok and all(state == "landed" for state in states)
    lost: CollectiveError | None = None
    try:
        if not agreement.settle(mine) and mine:
            problems.append("another rank's part failed")
    except CollectiveError as exc:
        lost = exc
        problems.append(one_line(exc))
    if lead:
        outcome = decide(states, problems, was_ready=window.ready)
    else:
        outcome = Outcome("label") if not problems else Outcome("keep", "; ".join(problems))
    outcome = _end(window, version, outcome, lead)
    if lost is not None:
        raise lost
    agreement.wait()  # decided before any rank returns
    if outcome.verdict != "label" or report is None:
        raise _unlabelled(version, outcome, report, lead)
    return report


def _connect(sender: WeightSender, source: WeightSource, version: int, agreement: Agreement, walk: bool) -> None:
    """Every rank's sender connected and its source's index read, or every rank raises before
    anything opens (`walk`: the source walked all the same).

    Raises:
        SyncFailed: a worker refused some rank's sender.
        Whatever this rank's source's index raised.
    """
    refused = sender.connect()
    unreadable = _raised(source.metas)
    if agreement.settle(not refused and unreadable is None):
        return
    if unreadable is not None:
        raise unreadable
    if walk:
        for _ in source.tensors():  # materialising a tensor may be a collective others are in
            pass
    report = not_pushed(version, sender.addresses, refused)
    causes = [outcome.cause() for outcome in report.failed if outcome.address in refused]
    raise _unlabelled(version, Outcome("keep", "; ".join(causes) or "another rank's sender was refused"), report)


def _push_beside(
    sender: WeightSender,
    source: WeightSource,
    version: int,
    window: UpdateWindow | None,
    wait_s: float,
    deadline: float | None,
) -> tuple[SyncReport | None, list[str]]:
    """The push, with the window's update call beside it (leading rank): the push's report
    (None if it raised) and what went wrong."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-round")
    try:
        update = pool.submit(window.update, version) if window is not None else None
        report, raised = _pushed(sender, source, version, deadline)
        problems = [f"the push failed: {one_line(raised)}"] if raised is not None else []
        problems += [outcome.cause() for outcome in report.failed] if report is not None else []
        failed = _error_of(update, wait_s) if update is not None else None
        problems += [f"the update call: {one_line(failed)}"] if failed is not None else []
    finally:
        pool.shutdown(wait=False)  # never join a control-plane thread on the error path
    return report, problems


def _end(window: UpdateWindow, version: int, outcome: Outcome, lead: bool) -> Outcome:
    """The leading rank ends the window with `outcome` (a label the engine refused: not ready,
    the version landed under no label); generation resumes unless not ready."""
    if not lead:
        return outcome
    try:
        window.finish(version, outcome)
    except Exception as exc:
        if outcome.verdict != "label":
            raise
        outcome = decide(["changed"], [f"the engine refused the label: {one_line(exc)}"])
        window.finish(version, outcome)
    if outcome.ready and isinstance(window, Pausing):
        window.resume()
    return outcome


def _unlabelled(version: int, outcome: Outcome, report: SyncReport | None, lead: bool = True) -> SyncFailed:
    if not lead:
        state = "the leading rank decided what the engine serves"
    elif outcome.verdict == "keep":
        state = "the previous weights serve, labelled as before"
    else:
        state = "the engine is not ready: it serves nothing until a push lands"
    return SyncFailed(f"version {version} was not labelled: {outcome.why} ({state})", report)


def not_pushed(version: int, addresses: list[str], refused: dict[str, WeightSyncError]) -> SyncReport:
    """The report of a push that never started: the workers in `refused` would not take the
    sender (why), so no worker was sent anything."""
    outcomes = []
    for address in addresses:
        error = refused.get(address)
        if error is None:
            outcomes.append(ReceiverOutcome(address, False, "SyncFailed", "not pushed: the round did not open"))
        else:
            kind = error.kind if isinstance(error, RemoteError) and error.kind else type(error).__name__
            outcomes.append(ReceiverOutcome(address, False, kind, str(error)))
    return SyncReport(version, 0, 0, 0, 0, 0.0, tuple(outcomes))


def _raised(call: Callable[..., object], *args: object) -> Exception | None:
    """What `call(*args)` raised (None: it returned)."""
    try:
        call(*args)
    except Exception as exc:
        return exc
    return None


def _pushed(
    sender: WeightSender, source: WeightSource, version: int, deadline: float | None
) -> tuple[SyncReport | None, BaseException | None]:
    """The push's report, or what it raised (every rank and the window hear of it first)."""
    try:
        return sender.push(source, version, deadline=deadline), None
    except Exception as exc:
        return None, exc


def _error_of(future: Future[None], timeout: float) -> BaseException | None:
    """What `future` raised (None: it returned), or a TimeoutError once `timeout` passed."""
    try:
        return future.exception(timeout=timeout)
    except TimeoutError:
        return TimeoutError(f"no answer within {timeout:g} s")
