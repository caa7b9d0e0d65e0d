"""A push's report read by people: one line, bytes and milliseconds (GB/s only where it says
something), and a push that nobody committed reports no bytes moved."""

from __future__ import annotations

from weightsync import ReceiverOutcome, SyncReport
from weightsync.report import moved


def report(*outcomes: ReceiverOutcome, total_bytes: int = 300, seconds: float = 0.003) -> SyncReport:
    return SyncReport(1, total_bytes, 2, 1, 4096, seconds, outcomes)


def test_a_latency_bound_sync_reads_in_bytes_and_milliseconds() -> None:
    assert moved(300, 0.003) == "300 bytes in 3.0 ms"
    assert moved(2_000_000_000, 1.0) == "2000000000 bytes in 1000.0 ms (2.00 GB/s)"
    assert moved(0, 0.0) == "0 bytes in 0.0 ms"


def test_a_committed_push_says_what_moved() -> None:
    done = report(ReceiverOutcome("tcp://a", True))
    assert (
        done.summary() == "version 1 committed on 1 of 1 receivers (full): 2 tensors, 300 bytes on the wire in 3.0 ms"
    )
    assert done.failure() == ""


def test_a_delta_push_reports_its_wire_bytes_and_mode() -> None:
    """A delta push moves less than it pushes: the line says so, and which receivers got which."""
    delta = ReceiverOutcome("tcp://a", True, mode="delta", wire_bytes=40)
    full = ReceiverOutcome("shm://b", True, wire_bytes=300)
    mixed = SyncReport(2, 300, 2, 1, 4096, 0.003, (delta, full), wire_bytes=340)
    assert mixed.summary() == (
        "version 2 committed on 2 of 2 receivers (delta 1, full 1): 2 tensors, 340 bytes on the wire in 3.0 ms "
        "(of 300 pushed)"
    )
    alone = SyncReport(2, 300, 2, 1, 4096, 0.003, (delta,), wire_bytes=40)
    assert alone.summary().startswith(
        "version 2 committed on 1 of 1 receivers (delta): 2 tensors, 40 bytes on the wire"
    )


def test_a_refused_push_says_who_refused_it_and_why_and_moves_no_bytes() -> None:
    fix = "push float32 (cast=torch.float32, or no cast) or serve a bfloat16 model"
    refused = report(
        ReceiverOutcome(
            "tcp://a", False, "PlanError", f"the push sends bfloat16 where this receiver holds float32: {fix}"
        ),
        ReceiverOutcome("tcp://b", False, "PlanError", "unknown tensor 'x'"),
        total_bytes=2_000_000_000,
        seconds=1.0,
    )
    line = refused.summary()
    assert line.startswith("version 1 refused by every receiver (2): tcp://a, tcp://b; the first: PlanError: ")
    assert line.endswith(fix) and "bytes" not in line and "GB/s" not in line, line
    assert refused.failure().startswith("version 1 did not commit on 2 of 2 receivers: tcp://a, tcp://b; ")


def test_a_failure_is_one_line_whatever_the_peer_sent() -> None:
    broken = report(
        ReceiverOutcome("tcp://a", True),
        ReceiverOutcome("tcp://b", False, "SinkError", "Traceback (most recent call last):\n  ...\nRuntimeError: boom"),
    )
    assert broken.failure() == (
        "version 1 did not commit on 1 of 2 receivers: tcp://b: SinkError: Traceback (most recent call last): ... "
        "RuntimeError: boom"
    )
    assert "\n" not in broken.summary() and broken.summary().endswith("1 did not: " + broken.failed[0].cause())
    assert (
        report(broken.outcomes[1]).summary().startswith("version 1 failed on every receiver (1): tcp://b: SinkError: ")
    )


def test_a_fleet_push_reads_as_one_line_too() -> None:
    from weightsync.cluster.ray_fleet import FleetReport

    fleet = FleetReport(report(ReceiverOutcome("tcp://a", True)), {"server-1": "died:\nSIGKILL"}, ("server-2",))
    assert fleet.summary() == (
        "version 1 committed on 1 of 1 receivers (full): 2 tensors, 300 bytes on the wire in 3.0 ms; "
        "dropped: server-1 (died: ... SIGKILL); joined: server-2"
    )
