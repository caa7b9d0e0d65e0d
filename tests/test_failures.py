"""Failure paths with real processes: a sender or receiver killed with SIGKILL mid-sync, a peer
that stalls, a sender that dies while its shared-memory ring still has names. After each, the
survivors say what happened (version, bucket), no receiver claims a version it does not hold
intact, nothing is left in /dev/shm, and the next push succeeds.

cudaipc runs the one-to-one cases on a GPU host (marked `gpu`), its destinations on the GPU. Its
sender and receivers must be different processes (CUDA IPC does not open a handle in the process
that exported it), so its pushes come from a child process (`tests.peer_process.sending`), while
the receivers, their sinks and the assertions stay here, as for shm and tcp.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.helpers import (
    PROCESS_TRANSPORTS,
    SHM_DIR,
    WAIT_S,
    Recorder,
    assert_all_bit_exact,
    needs,
    receiving,
    shm_segments,
    wait_until,
)
from tests.peer_process import sending
from weightsync import (
    CollectiveError,
    PeerClosedError,
    SyncReport,
    TransferTimeout,
    WeightReceiver,
    WeightSender,
    WeightSink,
)

pytestmark = pytest.mark.slow

ONE_TO_ONE = ["shm", "tcp", "nixl", pytest.param("cudaipc", marks=pytest.mark.gpu)]
"""Transports where each receiver has its own stream, so one receiver's fault is its alone.
The collective transport fails its whole group instead: its cases are at the end."""


def device_for(transport: str) -> str:
    """Where the receivers' destinations live: on the GPU for cudaipc (a colocated engine's)."""
    return "cuda" if transport == "cudaipc" else "cpu"


N = 1 << 14
"""Elements per tensor in the child programs (64 KiB of float32: one bucket each)."""

SENDER_CHILD = f"""
import sys, time, torch
from weightsync import TensorMeta, WeightSender

address, version, stall_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
N = {N}

class Slow:
    def metas(self):
        return [TensorMeta(f"t{{i}}", (N,), torch.float32) for i in range(3)]

    def tensors(self):
        for i in range(3):
            if i == stall_at:
                print("STALLED", flush=True)
                time.sleep(120)
            yield f"t{{i}}", torch.full((N,), float(i + 1), device=device)

sender = WeightSender([address], bucket_bytes=N * 4, timeout=120)
good = {{f"t{{i}}": torch.full((N,), -1.0, device=device) for i in range(3)}}
assert sender.push(good, version=version - 1).ok
print("PUSHED", flush=True)
sender.push(Slow(), version=version)
print("UNEXPECTED END", flush=True)
"""

STAGED_SENDER_CHILD = f"""
import sys, time, torch
from weightsync import WeightSender
from weightsync.transports import ring

address, version = sys.argv[1], int(sys.argv[2])
N = {N}
stall = [False]
send = ring.RingSendPlane.send

def stalling(self, index, *args):
    if stall[0] and index == 1:  # the big tensor's first piece is in the staging area, the rest is not
        print("STALLED staging_bytes", self._ring.staging_bytes, flush=True)
        time.sleep(120)
    return send(self, index, *args)

ring.RingSendPlane.send = stalling

def model(value):
    return {{"big": torch.full((3 * N,), float(value)), "small": torch.full((N,), float(value))}}

sender = WeightSender([address], bucket_bytes=N * 4, timeout=120)
for earlier in (version - 2, version - 1):  # the first tells the sender the receiver lends; the second is staged
    assert sender.push(model(earlier), version=earlier).ok
print("PUSHED", flush=True)
stall[0] = True
sender.push(model(version), version=version)
print("UNEXPECTED END", flush=True)
"""

RECEIVER_CHILD = """
import sys, time
from weightsync import WeightReceiver

def load(named):
    print("LOADING", flush=True)
    time.sleep(120)

receiver = WeightReceiver(load, transport=sys.argv[1], timeout=120).start()
print("ADDRESS", receiver.address, flush=True)
time.sleep(120)
"""


class Child:
    """A Python child process whose stdout lines the test waits on, killed on exit."""

    def __init__(self, code: str, *args: object) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 180.0) -> str:
        """The next line starting with `prefix` (child start-up imports torch, and nixl's its
        agents: on a host at load 7, that took over a minute)."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"child {self.pid} never printed {prefix!r}") from None
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        """SIGKILL, then reap: a zombie's pid still counts as alive."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(WAIT_S)
        assert self.proc.stdout is not None
        self._reader.join(WAIT_S)
        self.proc.stdout.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


def receiver_error(sink: Recorder) -> str:
    """The error the sink was aborted with, shortened for the fault table."""
    return f"{type(sink.aborts[0][1]).__name__}: {sink.aborts[0][1]}"[:110] if sink.aborts else "none"


def segments_of(pid: int) -> set[str]:
    return shm_segments(pid)


def killed_and_noticed(child: Child, receiver: WeightReceiver) -> float:
    """kill -9 `child`, the sender of the sync `receiver` is in; seconds until the receiver noticed."""
    child.kill()
    killed = time.monotonic()
    assert wait_until(lambda: receiver.state != "syncing"), "the receiver noticed the dead sender"
    return time.monotonic() - killed


def healthy_push(receiver: WeightReceiver, dest: dict[str, torch.Tensor] | None, version: int) -> None:
    """A fresh sender in this process pushes to `receiver`, and it commits intact."""
    names = list(dest) if dest is not None else ["t0", "t1", "t2"]
    source = {name: torch.full((N,), float(version * 10 + i)) for i, name in enumerate(names)}
    with sending(receiver.address) as sender:
        report = sender.push(source, version=version)
    assert report.ok, report.failed
    assert receiver.version == version and receiver.state == "ready" and receiver.last_error == ""
    if dest is not None:
        assert_all_bit_exact(dest, source)


def push_past_a_stall(sender: WeightSender, source: dict[str, torch.Tensor], gate: threading.Event) -> SyncReport:
    """Push version 1 while a receiver's sink is held on `gate`; the push must return on its own
    (the sender's timeout), before the gate is released."""
    reports = []
    pusher = threading.Thread(target=lambda: reports.append(sender.push(source, version=1)))
    pusher.start()
    try:
        pusher.join(WAIT_S)
        assert not pusher.is_alive(), "push waited on a stalled receiver past its timeout"
    finally:
        gate.set()
        pusher.join(WAIT_S)
    (report,) = reports
    return report


# --- the sender dies --------------------------------------------------------------------------


@pytest.mark.fault(
    "kill -9 of the sender mid-sync",
    expected="receiver notices, names version and bucket, sink aborted; `dirty` if live bytes were written, else the previous version stays; next push commits",
)
@pytest.mark.parametrize("transport", ONE_TO_ONE)
@pytest.mark.parametrize("stall_at", [1, 0], ids=["after-first-bucket", "before-any-bucket"])
def test_sender_killed_mid_sync(transport, stall_at, observe):
    dest = {f"t{i}": torch.zeros(N, device=device_for(transport)) for i in range(3)}
    sink = Recorder(dest)
    with (
        receiving(sink, transport, timeout=60) as receiver,
        Child(SENDER_CHILD, receiver.address, 5, stall_at, device_for(transport)) as child,
    ):
        child.expect("PUSHED")
        assert receiver.version == 4
        child.expect("STALLED")
        assert wait_until(lambda: receiver.state == "syncing")
        if stall_at == 1:
            # bucket 0 went straight into the live tensor before the sender stalled
            assert wait_until(lambda: bool((dest["t0"] == 1.0).all()))
        noticed = killed_and_noticed(child, receiver)
        assert f"version={5}" in receiver.last_error and f"bucket={stall_at}" in receiver.last_error
        assert "version 5" in receiver.last_error
        assert [version for version, _ in sink.aborts] == [5]
        assert isinstance(sink.aborts[0][1], PeerClosedError)
        assert "commit" not in [hook for hook, version in sink.calls if version == 5]
        if stall_at == 1:
            assert (receiver.state, receiver.version) == ("dirty", None), "never claim a version not held intact"
        else:
            assert (receiver.state, receiver.version) == ("ready", 4), "nothing live was touched: version 4 stays"
            assert all(bool((t == -1.0).all()) for t in dest.values())
        assert not segments_of(child.pid)

        healthy_push(receiver, dest, version=6)
        observe(
            f"noticed in {noticed:.2f} s (timeout 60 s): `{receiver_error(sink)}`; state after: "
            f"{'dirty' if stall_at == 1 else 'ready, version 4'}; no segment of the dead sender left; version 6 committed"
        )


@pytest.mark.fault(
    "kill -9 of the sender with a tensor larger than a bucket half written to the shm staging area (a loader sink)",
    expected="receiver notices, names version and bucket, sink aborted; the loader is never handed the half-written tensor; the previous version stays; no segment left; next push commits",
)
def test_sender_killed_with_a_tensor_half_staged(observe):
    sink = Recorder()  # no destinations: a loader, lent what it is handed
    with (
        receiving(sink, "shm", timeout=60) as receiver,
        Child(STAGED_SENDER_CHILD, receiver.address, 5) as child,
    ):
        child.expect("PUSHED")
        assert receiver.version == 4 and bool((sink.received["big"] == 4.0).all())
        staging_bytes = int(child.expect("STALLED").split()[-1])
        assert staging_bytes >= 3 * N * 4, "the sender's ring has a staging area for the big tensor"
        assert wait_until(lambda: receiver.state == "syncing")
        loads_before = [call for call in sink.calls if call[0] == "load"]
        noticed = killed_and_noticed(child, receiver)
        assert "version=5" in receiver.last_error and "bucket=1" in receiver.last_error
        assert [version for version, _ in sink.aborts] == [5]
        assert isinstance(sink.aborts[0][1], PeerClosedError)
        handed = [call for call in sink.calls if call[0] == "load"][len(loads_before) :]
        assert not handed, "the loader was handed nothing of the broken sync"
        assert (receiver.state, receiver.version) == ("ready", 4)
        assert not segments_of(child.pid)

        source = {"big": torch.full((3 * N,), 6.0), "small": torch.full((N,), 6.0)}
        with sending(receiver.address, bucket_bytes=N * 4) as sender:
            assert sender.push(source, version=6).ok
        assert_all_bit_exact({name: sink.received[name] for name in source}, source)
        observe(
            f"noticed in {noticed:.2f} s (timeout 60 s): `{receiver_error(sink)}`; the loader was handed "
            f"nothing of version 5 (its ring's staging area: {staging_bytes} bytes); state after: ready, "
            "version 4; no segment of the dead sender left; "
            "version 6 committed"
        )


@pytest.mark.fault(
    "the sender stalls mid-sync (alive, silent)",
    expected="receiver gives up after its timeout naming version and bucket, sink aborted, previous state kept; next push commits",
)
@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)  # inproc has no wait of its own: it runs in push
def test_sender_stalling_times_the_receiver_out(transport, observe):
    """A sender that stops sending mid-sync (alive, silent): the receiver gives up after its
    timeout, names version and bucket, and tells the sink."""
    gate = threading.Event()

    class Stuck:
        def metas(self):  # type: ignore[no-untyped-def]
            from weightsync import TensorMeta

            return [TensorMeta("t0", (N,), torch.float32), TensorMeta("t1", (N,), torch.float32)]

        def tensors(self):  # type: ignore[no-untyped-def]
            yield "t0", torch.ones(N)
            gate.wait(WAIT_S)
            yield "t1", torch.ones(N)

    sink = Recorder()
    timeout = 2.0 if transport == "nixl" else 0.5  # nixl's agents took over 0.5 s to meet on a loaded host
    with (
        receiving(sink, transport, timeout=timeout) as receiver,
        sending(receiver.address, bucket_bytes=N * 4, raise_on_failure=False) as sender,
    ):
        # a first push sets the link up: the stall below is mid-sync, never in the set-up (a
        # set-up slower than the timeout on a loaded host fails that push; the next one connects again)
        for held in (1, 2, 3):
            warm = sender.push({"t0": torch.zeros(N), "t1": torch.zeros(N)}, version=held)
            if warm.ok:
                break
        assert warm.ok, warm.failed
        sink.aborts.clear()
        sink.aborted.clear()
        reports = []
        thread = threading.Thread(target=lambda: reports.append(sender.push(Stuck(), version=5)))
        started = time.monotonic()
        thread.start()
        try:
            assert sink.aborted.wait(WAIT_S), "the receiver never gave up"
            gave_up = time.monotonic() - started
            assert isinstance(sink.aborts[0][1], TransferTimeout)
            assert wait_until(lambda: receiver.state != "syncing")
            assert "version=5" in receiver.last_error and "bucket=1" in receiver.last_error
            assert receiver.state == "ready" and receiver.version == held
        finally:
            gate.set()
            thread.join(WAIT_S)
        assert not thread.is_alive()
        assert not reports[0].ok
        healthy_push(receiver, None, version=6)
        observe(
            f"receiver gave up after {gave_up:.2f} s (timeout {timeout} s): `{receiver_error(sink)}`; "
            f"state stayed ready at version {held}; sender reported {reports[0].failed[0].kind}; version 6 committed"
        )


@pytest.mark.fault(
    "the sender stalls mid-sync (alive, silent) (cudaipc)",
    expected="receiver gives up after its timeout naming version and bucket, sink aborted, previous state kept; next push commits",
)
@pytest.mark.gpu
def test_cudaipc_sender_stalling_times_the_receiver_out(observe):
    """The case above over cudaipc, whose sender must be another process: a child pushes version
    2, then goes silent in version 3 after its first bucket."""
    sink = Recorder()
    with (
        receiving(sink, "cudaipc", timeout=2.0) as receiver,
        Child(SENDER_CHILD, receiver.address, 3, 1, "cuda") as child,
    ):
        child.expect("PUSHED")
        assert receiver.version == 2
        child.expect("STALLED")
        stalled = time.monotonic()
        assert sink.aborted.wait(WAIT_S), "the receiver never gave up"
        gave_up = time.monotonic() - stalled
        assert isinstance(sink.aborts[0][1], TransferTimeout)
        assert [version for version, _ in sink.aborts] == [3]
        assert wait_until(lambda: receiver.state != "syncing")
        assert "version=3" in receiver.last_error and "bucket=1" in receiver.last_error
        assert (receiver.state, receiver.version) == ("ready", 2), "bucket 0 was staged, not live: version 2 stays"
        healthy_push(receiver, None, version=4)
        observe(
            f"receiver gave up {gave_up:.2f} s after the sender went silent (timeout 2 s): `{receiver_error(sink)}`; "
            "state stayed ready, version 2; version 4 committed"
        )


# --- a receiver dies or stalls ------------------------------------------------------------------


@pytest.mark.fault(
    "kill -9 of a receiver mid-sync",
    expected="the sender reports that receiver failed (naming version) and completes the others; next push commits on the rest",
)
@pytest.mark.parametrize("transport", ONE_TO_ONE)
def test_receiver_killed_mid_sync(transport, observe):
    dest = {f"t{i}": torch.zeros(N, device=device_for(transport)) for i in range(4)}
    source = {f"t{i}": torch.full((N,), float(i)) for i in range(4)}
    with Child(RECEIVER_CHILD, transport) as victim, receiving(dest, transport) as healthy:
        address = victim.expect("ADDRESS").split()[1]
        killer = threading.Thread(target=lambda: (victim.expect("LOADING"), victim.kill()))
        killer.start()
        with sending([address, healthy.address], bucket_bytes=N * 4, timeout=WAIT_S, raise_on_failure=False) as sender:
            try:
                report = sender.push(source, version=1)
            finally:
                killer.join(WAIT_S)
            assert [o.address for o in report.failed] == [address]
            assert report.failed[0].kind == "PeerClosedError", report.failed[0]
            assert "version=1" in report.failed[0].error
            assert healthy.version == 1
            assert_all_bit_exact(dest, source)
            assert not segments_of(victim.pid)

            # the same sender goes on: the dead receiver is unreachable, the other commits
            first = report
            report = sender.push(source, version=2)
            assert [(o.address, o.kind) for o in report.failed] == [(address, "ConnectError")]
            assert healthy.version == 2
        healthy_push(healthy, dest, version=3)
        observe(
            f"push took {first.seconds:.2f} s: dead receiver {first.failed[0].kind} "
            f"(`{first.failed[0].error[:80]}`), the other committed bit-exact; next push: dead one ConnectError, other committed"
        )


@pytest.mark.fault(
    "a receiver stalls mid-sync",
    expected="the sender times it out (TransferTimeout, naming version) and completes the others; the stalled one claims nothing it lacks; next push commits on both",
)
@pytest.mark.parametrize("transport", ONE_TO_ONE)
def test_receiver_stalling_is_timed_out_and_the_others_complete(transport, observe):
    gate = threading.Event()
    slow = Recorder(gate=gate)
    dest = {f"t{i}": torch.zeros(N, device=device_for(transport)) for i in range(4)}
    source = {f"t{i}": torch.full((N,), float(i)) for i in range(4)}
    with (
        receiving(slow, transport, timeout=WAIT_S) as stalled,
        receiving(dest, transport) as healthy,
        sending([stalled.address, healthy.address], bucket_bytes=N * 4, timeout=1.0, raise_on_failure=False) as sender,
    ):
        report = push_past_a_stall(sender, source, gate)
        assert [(o.address, o.kind) for o in report.failed] == [(stalled.address, "TransferTimeout")]
        assert "version=1" in report.failed[0].error
        assert healthy.version == 1
        assert_all_bit_exact(dest, source)

        # The stalled receiver, once unstuck, finds its sender gone and aborts, claiming nothing.
        # Over tcp every byte and the commit may already sit in its socket buffer, and over
        # cudaipc a sync of held tensors needs no per-bucket ack (its receivers read the sender's
        # memory): then it may commit instead, but only with the version intact.
        assert wait_until(lambda: slow.aborts or ("commit", 1) in slow.calls)
        assert wait_until(lambda: stalled.state != "syncing")
        if slow.aborts:
            assert [version for version, _ in slow.aborts] == [1]
            assert stalled.state == "empty" and stalled.version is None and "version 1" in stalled.last_error
        else:
            assert transport in ("tcp", "cudaipc"), "over shm each bucket is acked: a stalled receiver cannot commit"
            assert stalled.version == 1 and stalled.state == "ready"
            assert_all_bit_exact(slow.received, source)

        slow.gate = None
        first = report
        report = sender.push(source, version=2)
        assert report.ok, report.failed
        assert stalled.version == 2 and healthy.version == 2
        observe(
            f"push returned in {first.seconds:.2f} s (sender timeout 1 s): stalled receiver "
            f"{first.failed[0].kind}, the other committed; once unstuck the stalled one "
            f"{'aborted' if slow.aborts else 'committed the intact version (tcp)'}; version 2 committed on both"
        )


# --- nixl: a receiver gone between its target and the first write --------------------------------

NIXL_RECEIVER_CHILD = f"""
import sys, time, torch
from weightsync import WeightReceiver

dest = {{f"t{{i}}": torch.zeros({N}) for i in range(4)}}
receiver = WeightReceiver(dest, transport="nixl", timeout=120).start()
print("ADDRESS", receiver.address, flush=True)
time.sleep(120)
"""


@pytest.mark.fault(
    "a receiver dies between the handshake and the first write (nixl)",
    expected="the sender's first write to it fails (PeerClosedError, naming version and bucket 0) within the timeout, the other receiver commits; no registered memory left; next push: ConnectError for the dead one, the other commits",
)
@needs("nixl")
def test_nixl_receiver_gone_before_the_first_write(observe):
    from weightsync.transports.nixl import live_registrations

    dest = {f"t{i}": torch.zeros(N) for i in range(4)}
    source = {f"t{i}": torch.full((N,), float(i)) for i in range(4)}
    targets_loaded, victim_dead = threading.Event(), threading.Event()

    class AfterTheHandshake:
        """Yields nothing until the victim is dead: by then its target (agent metadata, sites)
        was loaded by the sender, which next writes bucket 0 into the dead process."""

        def metas(self):  # type: ignore[no-untyped-def]
            from weightsync import TensorMeta

            return [TensorMeta(name, (N,), torch.float32) for name in source]

        def tensors(self):  # type: ignore[no-untyped-def]
            targets_loaded.set()
            assert victim_dead.wait(WAIT_S)
            yield from source.items()

    before = live_registrations()
    with Child(NIXL_RECEIVER_CHILD) as victim, receiving(dest, "nixl") as healthy:
        address = victim.expect("ADDRESS").split()[1]
        killer = threading.Thread(target=lambda: (targets_loaded.wait(WAIT_S), victim.kill(), victim_dead.set()))
        killer.start()
        with sending([address, healthy.address], bucket_bytes=N * 4, timeout=WAIT_S, raise_on_failure=False) as sender:
            try:
                report = sender.push(AfterTheHandshake(), version=1)
            finally:
                killer.join(WAIT_S)
            assert [o.address for o in report.failed] == [address]
            assert report.failed[0].kind in ("PeerClosedError", "TransportError"), report.failed[0]
            assert "version=1" in report.failed[0].error and "bucket=0" in report.failed[0].error
            assert report.seconds < WAIT_S, "the dead receiver was noticed before the timeout"
            assert healthy.version == 1
            assert_all_bit_exact(dest, source)

            first = report
            report = sender.push(source, version=2)
            assert [(o.address, o.kind) for o in report.failed] == [(address, "ConnectError")]
            assert healthy.version == 2
    assert wait_until(lambda: live_registrations() == before), "registered memory was released"
    observe(
        f"push took {first.seconds:.2f} s (timeout {WAIT_S:.0f} s): dead receiver {first.failed[0].kind} "
        f"(`{first.failed[0].error[:70]}`), the other committed bit-exact; next push: dead one ConnectError, "
        "other committed; no registration left"
    )


# --- shared memory: nothing left behind ----------------------------------------------------------


class HoldsBegin(WeightSink):
    """Holds the sync open inside `begin`, i.e. while the sender's ring still has names."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.aborts: list[int] = []

    def begin(self, plan, version):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.release.wait(WAIT_S)

    def load(self, named):  # type: ignore[no-untyped-def]
        pass

    def abort(self, version, error, *, intact):  # type: ignore[no-untyped-def]
        self.aborts.append(version)


def test_sender_killed_while_its_ring_has_names_leaves_nothing_behind():
    sink = HoldsBegin()
    with receiving(sink, "shm", timeout=60) as receiver:
        with Child(SENDER_CHILD, receiver.address, 5, 9) as child:
            # the child's first push creates the ring; its names live until every receiver accepts
            assert sink.entered.wait(60)
            assert segments_of(child.pid), "the ring is named while receivers map it"
            child.kill()  # reaped inside: its pid is gone
            assert segments_of(child.pid), "a SIGKILLed sender cannot unlink its own ring"
            sink.release.set()
            # the receiver's connection drops; it aborts and reaps the dead sender's segments
            assert wait_until(lambda: not segments_of(child.pid)), "stale segments were not reaped"
            assert wait_until(lambda: sink.aborts == [4])
            assert receiver.version is None and receiver.state == "empty"
            assert "version 4" in receiver.last_error
        healthy_push(receiver, None, version=6)


def test_stale_segments_of_dead_processes_are_reaped_by_the_next_ring():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    token = secrets.token_hex(6)
    stale = [f"weightsync-{dead_pid}-{token}-{slot}" for slot in (0, 1)]
    mine = f"weightsync-{os.getpid()}-{secrets.token_hex(6)}-0"  # a live process's: kept
    unrelated = f"weightsync-notasegment-{token}"  # not the segment pattern: kept
    made = [*stale, mine, unrelated]
    try:
        for name in made:
            with open(os.path.join(SHM_DIR, name), "wb") as f:
                f.write(b"\x00" * 64)
        with receiving(Recorder(), "shm") as receiver, sending(receiver.address) as sender:
            assert sender.push({"w": torch.ones(8)}, version=1).ok  # creates a ring
        left = shm_segments()
        assert not set(stale) & left, "dead process's segments survived"
        assert {mine, unrelated} <= left, "a live or unrelated file was removed"
    finally:
        for name in made:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def test_no_segment_outlives_the_offer():
    """Segments exist only while receivers map the ring: by the time push returns, and for as
    long as the sender lives, /dev/shm holds nothing of it."""
    before = shm_segments(os.getpid())
    with receiving(Recorder(), "shm") as receiver, sending(receiver.address) as sender:
        for version in range(3):
            assert sender.push({"w": torch.ones(1000 * (version + 1))}, version=version).ok
            assert shm_segments(os.getpid()) == before


# --- collective: a fault in one member fails its group, within the timeout -----------------------


@pytest.mark.fault(
    "kill -9 of the sender mid-sync (collective)",
    expected="receiver notices at once (closed control connection or group), names version and bucket, sink aborted, the bucket in flight never lands: previous version stays; next push commits",
)
def test_collective_sender_killed_mid_sync(observe):
    dest = {f"t{i}": torch.zeros(N) for i in range(3)}
    sink = Recorder(dest)
    with receiving(sink, "collective", timeout=60) as receiver, Child(SENDER_CHILD, receiver.address, 5, 1) as child:
        child.expect("PUSHED")
        child.expect("STALLED")
        assert wait_until(lambda: receiver.state == "syncing")
        noticed = killed_and_noticed(child, receiver)
        assert "version=5" in receiver.last_error and "bucket=1" in receiver.last_error
        assert [version for version, _ in sink.aborts] == [5]
        assert isinstance(sink.aborts[0][1], (PeerClosedError, CollectiveError))
        # bucket 0 was received but is landed only once bucket 1 is under way: nothing was written
        assert (receiver.state, receiver.version) == ("ready", 4)
        assert all(bool((t == -1.0).all()) for t in dest.values())
        healthy_push(receiver, dest, version=6)
        observe(
            f"noticed in {noticed:.2f} s (timeout 60 s): `{receiver_error(sink)}`; state after: ready, version 4; version 6 committed"
        )


@pytest.mark.fault(
    "kill -9 of a receiver mid-sync (collective)",
    expected="the chain breaks at once: the dead receiver is reported gone, the rest of its group CollectiveError, no one claims the version; next push forms a new group and commits on the rest",
)
def test_collective_receiver_killed_mid_sync(observe):
    dest = {f"t{i}": torch.zeros(N) for i in range(4)}
    source = {f"t{i}": torch.full((N,), float(i)) for i in range(4)}
    with Child(RECEIVER_CHILD, "collective") as victim, receiving(dest, "collective") as healthy:
        address = victim.expect("ADDRESS").split()[1]
        killer = threading.Thread(target=lambda: (victim.expect("LOADING"), victim.kill()))
        killer.start()
        with sending([address, healthy.address], bucket_bytes=N * 4, timeout=WAIT_S, raise_on_failure=False) as sender:
            try:
                report = sender.push(source, version=1)
            finally:
                killer.join(WAIT_S)
            assert report.seconds < WAIT_S, "the group noticed the dead member before its timeout"
            failed = {o.address: o for o in report.failed}
            assert set(failed) == {address, healthy.address}
            assert "died" in failed[address].error or failed[address].kind == "PeerClosedError"
            assert failed[healthy.address].kind == "CollectiveError"
            assert wait_until(lambda: healthy.state != "syncing")
            assert healthy.version is None and healthy.state in ("empty", "dirty")

            first = report
            report = sender.push(source, version=2)
            assert [(o.address, o.kind) for o in report.failed] == [(address, "ConnectError")]
            assert healthy.version == 2
            assert_all_bit_exact(dest, source)
        observe(
            f"push returned in {first.seconds:.2f} s (timeout {WAIT_S:.0f} s): dead receiver "
            f"`{failed[address].error[:60]}`, the other {failed[healthy.address].kind}; "
            "next push: dead one ConnectError, the other committed bit-exact"
        )


@contextlib.contextmanager
def stalled_chain(healthy_timeout: float):  # type: ignore[no-untyped-def]
    """A collective sender (timeout 1 s) and two receivers: rank 1's sink is held on `gate`, rank
    2 writes into `dest` and waits `healthy_timeout` before it gives up on its own."""
    gate = threading.Event()
    slow = Recorder(gate=gate)
    dest = {f"t{i}": torch.zeros(N) for i in range(4)}
    source = {f"t{i}": torch.full((N,), float(i)) for i in range(4)}
    with (
        receiving(slow, "collective", timeout=WAIT_S) as stalled,
        receiving(dest, "collective", timeout=healthy_timeout) as healthy,
        sending([stalled.address, healthy.address], bucket_bytes=N * 4, timeout=1.0, raise_on_failure=False) as sender,
    ):
        yield gate, slow, stalled, healthy, sender, dest, source


@pytest.mark.fault(
    "a receiver stalls mid-sync (collective)",
    expected="the chain times out: every member fails with CollectiveError within the sender's timeout, none claims the version; next push (stall over) commits on all",
)
def test_collective_receiver_stalling_fails_the_group_within_the_timeout(observe):
    with stalled_chain(healthy_timeout=WAIT_S) as (gate, slow, stalled, healthy, sender, dest, source):
        report = push_past_a_stall(sender, source, gate)
        assert {o.kind for o in report.failed} == {"CollectiveError"} and len(report.failed) == 2
        assert all("stalled past the 1 s timeout" in outcome.error for outcome in report.failed), report.failed
        assert wait_until(lambda: stalled.state != "syncing" and healthy.state != "syncing")
        assert stalled.version is None and healthy.version is None

        slow.gate = None
        first = report
        report = sender.push(source, version=2)
        assert report.ok, report.failed
        assert stalled.version == 2 and healthy.version == 2
        assert_all_bit_exact(dest, source)
        observe(
            f"push returned in {first.seconds:.2f} s (sender timeout 1 s): both members CollectiveError "
            f"(`{first.failed[0].error[:70]}`); version 2 committed on both"
        )


@pytest.mark.fault(
    "a receiver in the middle of the chain stays stalled (collective)",
    expected="the sender fails the sync within its timeout and closes the stalled receiver's connection; that receiver lets go of the group though its own thread is still stuck, so the one after it fails at once, long before its own timeout; next push commits on all",
)
def test_collective_stall_mid_chain_fails_the_rest_of_the_chain_at_once(observe):
    with stalled_chain(healthy_timeout=6 * WAIT_S) as (gate, slow, stalled, last, sender, dest, source):
        reports = []
        pusher = threading.Thread(target=lambda: reports.append(sender.push(source, version=1)))
        started = time.monotonic()
        pusher.start()
        try:
            pusher.join(WAIT_S)
            assert reports and not reports[0].ok
            assert wait_until(lambda: last.state != "syncing"), "the last receiver waited past the sender's failure"
            after = time.monotonic() - started
            assert stalled.state == "syncing", "the stalled receiver's sink is still held"
            assert "left the group" in last.last_error and last.version is None
            error = last.last_error
        finally:
            gate.set()
            pusher.join(WAIT_S)
        assert wait_until(lambda: stalled.state != "syncing")
        slow.gate = None
        assert sender.push(source, version=2).ok
        assert stalled.version == 2 and last.version == 2
        assert_all_bit_exact(dest, source)
        observe(
            f"the last receiver failed {after:.2f} s after the push began (its own timeout {6 * WAIT_S:.0f} s, the "
            f"sender's 1 s) while the stalled one was still held: `{error[:90]}`; version 2 committed on both"
        )
