"""wire.py and the receiving end of the protocol: typed frames round-trip, anything else is a
ProtocolError before it is used or allocated for, and a hostile or broken peer on a raw socket
gets a clean refusal while the receiver keeps serving real senders."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import tracemalloc

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import (
    PROCESS_TRANSPORTS,
    WAIT_S,
    Recorder,
    assert_all_bit_exact,
    random_tensor,
    receiving,
    sending,
    wait_until,
)
from weightsync import PeerClosedError, ProtocolError, TransferTimeout
from weightsync.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accept,
    BucketDone,
    BucketReady,
    Commit,
    Committed,
    Failed,
    Hello,
    Offer,
    Piece,
    Plan,
    TensorSpec,
    Welcome,
)
from weightsync.plan import build_plan, plan_id
from weightsync.transports.collective import Group
from weightsync.transports.shm import Ring
from weightsync.transports.tcp import BucketData
from weightsync.wire import MAX_FRAME_BYTES, Connection, decode, encode

TRANSPORT_MESSAGES = (Ring, BucketData, Group)
"""Some transports' own messages, decoded here besides the core ones."""

HEADER = struct.Struct("!I")
PICKLED = pickle.dumps(Hello(PROTOCOL_VERSION, "pickled"))

# --- encode / decode ------------------------------------------------------------------------------

ints = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 2**31)
text = st.text(max_size=20)
pieces = st.builds(Piece, small, small, small, small)
specs = st.builds(TensorSpec, text, text, st.lists(small, max_size=4).map(tuple), text)
plans = st.builds(
    Plan,
    small,
    st.lists(specs, max_size=4).map(tuple),
    st.lists(st.lists(pieces, max_size=4).map(tuple), max_size=4).map(tuple),
    small,
)
messages = st.one_of(
    st.builds(Hello, ints, text),
    st.builds(Welcome, ints, text, ints, st.none() | ints),
    st.builds(Ring, st.lists(text, max_size=4).map(tuple), ints),
    st.builds(Offer, ints, plans, text),
    st.builds(Accept, ints),
    st.builds(BucketReady, ints, ints),
    st.builds(BucketData, ints, ints),
    st.builds(BucketDone, ints),
    st.builds(Commit, ints, text),
    st.builds(Committed, ints),
    st.builds(Abort, ints, text),
    st.builds(Failed, ints, text, text),
)


@given(message=messages)
def test_every_message_round_trips(message):
    assert decode(encode(message), TRANSPORT_MESSAGES) == message
    assert type(decode(encode(message), TRANSPORT_MESSAGES)) is type(message)


@pytest.mark.parametrize(
    ("message", "transport"),
    [
        (Ring(("weightsync-1-0123456789ab-0",), 64), "tcp"),
        (BucketData(0, 8), "shm"),
        (Group("h", 1, "p", 1, 2, "gloo"), "shm"),
    ],
)
def test_a_link_decodes_only_the_core_messages_and_its_transports(message, transport):
    from weightsync.transports import get_transport

    own = get_transport(type(message).__module__.rpartition(".")[2]).messages
    assert decode(encode(message), own) == message
    with pytest.raises(ProtocolError, match="malformed"):
        decode(encode(message), get_transport(transport).messages)


def test_invalid_utf8_in_a_string_field_is_a_protocol_error():
    """Found by the atheris fuzzer: msgspec raises UnicodeDecodeError there, not a DecodeError."""
    frame = encode(Abort(1, "x" * 8)).replace(b"x" * 8, b"\xff" * 8)
    with pytest.raises(ProtocolError, match="malformed"):
        decode(frame)


@given(data=st.binary(max_size=200))
def test_garbage_is_a_protocol_error_or_a_message(data):
    try:
        message = decode(data, TRANSPORT_MESSAGES)
    except ProtocolError:
        return
    assert encode(message)  # whatever decodes is one of the typed messages


@pytest.mark.parametrize(
    "payload",
    [
        {"type": "Hello", "protocol": "1", "sender_id": "x"},
        {"type": "Hello", "protocol": 1},
        {"type": "Hello", "protocol": 1, "sender_id": 5},
        {"type": "Evil", "protocol": 1},
        {"protocol": 1, "sender_id": "x"},
        {"type": "Accept", "version": 1.5},
        {"type": "Accept", "version": True},
        {"type": "Offer", "version": 1, "plan": {"bucket_bytes": 64}, "digest": ""},
        {"type": "Offer", "version": 1, "plan": [1, 2, 3], "digest": ""},
        [1, 2, 3],
        "Hello",
        None,
    ],
    ids=lambda p: str(p)[:40],
)
def test_wrong_types_are_protocol_errors(payload):
    with pytest.raises(ProtocolError, match="malformed control message"):
        decode(msgspec.msgpack.encode(payload))


def test_wrong_piece_shape_is_a_protocol_error():
    plan = {"bucket_bytes": 64, "tensors": [], "buckets": [[[0, 0, 0]]], "total_bytes": 0}
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode({"type": "Offer", "version": 1, "plan": plan, "digest": ""}))


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, ("/tmp/weightsync-test-pickle-was-executed",))


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(Hello(PROTOCOL_VERSION, "x")),
        pickle.dumps({"type": "Hello", "protocol": PROTOCOL_VERSION, "sender_id": "x"}),
        pickle.dumps(_Boom()),
        pickle.dumps(_Boom(), protocol=0),
    ],
    ids=["struct", "dict", "reduce", "reduce-protocol-0"],
)
def test_decoder_rejects_pickle_payloads(payload):
    marker = "/tmp/weightsync-test-pickle-was-executed"
    assert not os.path.exists(marker)
    with pytest.raises(ProtocolError):
        decode(payload)
    assert not os.path.exists(marker), "decoding ran pickle code"


def test_msgpack_extension_types_are_rejected():
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x00" * 8)))


def test_deep_nesting_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        decode(b"\x91" * 100_000)


# --- Connection over a socket pair ------------------------------------------------------------


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    left, right = socket.socketpair()
    conn = Connection(left, "test")
    yield conn, right
    conn.close()
    right.close()


def test_connection_round_trips_frames_and_raw_bytes(pair):
    conn, right = pair
    peer = Connection(right, "test")
    peer.send(Commit(7, "abc"), 1)
    assert conn.recv(1) == Commit(7, "abc")
    data = torch.arange(3 << 18, dtype=torch.int32)  # 3 MiB: more than one stream slice
    out = torch.empty_like(data)

    sender = threading.Thread(target=peer.send_bytes, args=(data.numpy(), 5))
    sender.start()
    conn.recv_into(out.numpy(), 5)
    sender.join(WAIT_S)
    assert torch.equal(out, data)


@pytest.mark.parametrize("length", [MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1])
def test_oversized_frame_is_refused_before_allocating(pair, length):
    conn, right = pair
    right.sendall(HEADER.pack(length))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="exceeds") as info:
            conn.recv(1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"allocated {peak} bytes for a refused frame"
    assert "transport=test" in str(info.value)
    assert "(transport=test, version=7, bucket=3)" in str(info.value.at(version=7, bucket=3))  # as a sync loop says


def test_frame_at_the_limit_is_read(pair):
    conn, right = pair
    body = encode(Failed(1, "X", "y" * (MAX_FRAME_BYTES - 64)))
    assert len(body) <= MAX_FRAME_BYTES

    writer = threading.Thread(target=right.sendall, args=(HEADER.pack(len(body)) + body,))
    writer.start()
    try:
        assert isinstance(conn.recv(5), Failed)
    finally:
        writer.join(WAIT_S)


@pytest.mark.parametrize("sent", [b"", b"\x00", b"\x00\x00\x00", HEADER.pack(10) + b"\x81"], ids=repr)
def test_peer_closing_mid_frame_is_peer_closed(pair, sent):
    conn, right = pair
    right.sendall(sent)
    right.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerClosedError, match="closed") as info:
        conn.recv(1)
    assert "version=7" in str(info.value.at(version=7))


def test_silent_peer_times_out_naming_where(pair):
    conn, _right = pair
    with pytest.raises(TransferTimeout, match=r"within 0.2 s \(transport=test\)") as info:
        conn.recv(0.2)
    assert str(info.value.at(version=7, bucket=3)).endswith("(transport=test, version=7, bucket=3)")


def test_garbage_frame_is_a_protocol_error(pair):
    conn, right = pair
    right.sendall(HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")
    with pytest.raises(ProtocolError):
        conn.recv(1)


# --- a raw peer against a live receiver ---------------------------------------------------------


class RawPeer:
    """A hand-driven sender on a plain socket: sends whatever bytes or messages a test likes."""

    def __init__(self, address: str) -> None:
        if not address.startswith("shm://"):  # tcp and collective listen on tcp
            host, _, port = address.partition("://")[2].rpartition(":")
            self.sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(WAIT_S)
            self.sock.connect("\0" + address.removeprefix("shm://@"))
        self.conn = Connection(self.sock, "raw")

    def send(self, message: object) -> None:
        self.conn.send(message, WAIT_S)  # type: ignore[arg-type]

    def recv(self) -> object:
        return self.conn.recv(WAIT_S)

    def hello(self) -> Welcome:
        self.send(Hello(PROTOCOL_VERSION, "raw-peer"))
        welcome = self.recv()
        assert isinstance(welcome, Welcome)
        return welcome

    def closed_by_receiver(self) -> bool:
        """True once the receiver has closed its end (EOF or reset), within the wait limit."""
        try:
            while True:
                if not self.sock.recv(1 << 16):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=PROCESS_TRANSPORTS)
def live(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """A receiver with destinations, listening on a socket transport."""
    dest = {"w": torch.zeros(64), "v": torch.zeros(3, dtype=torch.int64)}
    with receiving(dest, request.param, timeout=WAIT_S) as receiver:
        yield receiver, dest


def assert_still_serves(receiver, dest, version: int = 11) -> None:  # type: ignore[no-untyped-def]
    """A real sender can still push to `receiver` and it commits."""
    source = {"w": random_tensor(torch.float32, (64,), seed=version), "v": torch.tensor([1, 2, 3])}
    with sending(receiver.address) as sender:
        report = sender.push(source, version=version)
    assert report.ok, report.failed
    assert receiver.version == version and receiver.state == "ready"
    assert_all_bit_exact(dest, source)


def small_offer(version: int = 5, **plan_changes: object) -> Offer:
    plan = build_plan([TensorSpec("w", "float32", (64,), "float32"), TensorSpec("v", "int64", (3,), "int64")], 256)
    plan = msgspec.structs.replace(plan, **plan_changes)
    return Offer(version, plan, plan_id(plan))


@pytest.mark.parametrize(
    "data",
    [
        HEADER.pack(2**32 - 1),
        HEADER.pack(MAX_FRAME_BYTES + 1) + b"\x00" * 1000,
        HEADER.pack(8) + b"\xc1" * 8,
        HEADER.pack(len(PICKLED)) + PICKLED,
        b"\x00\x00",
        HEADER.pack(100) + b"\x80" * 10,
    ],
    ids=["huge-header", "oversized-with-bytes", "garbage", "pickle", "half-header", "half-body"],
)
@pytest.mark.fault(
    "a peer sends a broken first frame or closes mid-header",
    expected="that connection is closed with nothing allocated for it; receiver state unchanged; a real push still commits",
)
def test_broken_first_frame_closes_that_connection_only(live, data, observe):
    receiver, dest = live
    peer = RawPeer(receiver.address)
    try:
        try:
            peer.sock.sendall(data)
            peer.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the receiver may refuse the frame and close before we finish writing it
        else:
            assert peer.closed_by_receiver()
    finally:
        peer.close()
    assert receiver.state == "empty" and receiver.last_error == ""
    assert_still_serves(receiver, dest)
    observe(
        f"connection closed by the receiver; state {receiver.state}, no error recorded; the next real push committed"
    )


def test_silent_connection_does_not_block_real_senders(live):
    receiver, dest = live
    peer = RawPeer(receiver.address)
    try:
        assert_still_serves(receiver, dest)
    finally:
        peer.close()


@pytest.mark.parametrize(
    "first",
    [Hello(PROTOCOL_VERSION + 1, "future"), Hello(0, "past"), small_offer(), Commit(1, "x"), Welcome(1, "r", 64, None)],
    ids=["newer-protocol", "older-protocol", "offer", "commit", "welcome"],
)
def test_wrong_first_message_gets_a_protocol_failure(live, first):
    receiver, dest = live
    peer = RawPeer(receiver.address)
    try:
        peer.send(first)
        reply = peer.recv()
        assert isinstance(reply, Failed) and reply.kind == "ProtocolError"
        assert str(PROTOCOL_VERSION) in reply.message
        assert peer.closed_by_receiver()
    finally:
        peer.close()
    assert_still_serves(receiver, dest)


HOSTILE_OFFERS = {
    "bucket-above-limit": lambda: small_offer(bucket_bytes=1 << 40),
    "lying-total": lambda: small_offer(total_bytes=1),
    "digest-mismatch": lambda: Offer(5, small_offer().plan, "0" * 32),
    "piece-past-bucket": lambda: small_offer(buckets=((Piece(0, 0, 200, 256), Piece(1, 0, 0, 24)),)),
    "unknown-dtype": lambda: small_offer(
        tensors=(TensorSpec("w", "object", (64,), "float32"), TensorSpec("v", "int64", (3,), "int64"))
    ),
    "unknown-name": lambda: small_offer(
        tensors=(TensorSpec("w", "float32", (64,), "float32"), TensorSpec("nope", "int64", (3,), "int64"))
    ),
    "wrong-shape": lambda: small_offer(
        tensors=(TensorSpec("w", "float32", (8, 8), "float32"), TensorSpec("v", "int64", (3,), "int64"))
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_OFFERS))
def test_hostile_offer_is_refused_and_the_connection_survives(live, name):
    receiver, dest = live
    before = {k: v.clone() for k, v in dest.items()}
    peer = RawPeer(receiver.address)
    try:
        peer.hello()
        peer.send(HOSTILE_OFFERS[name]())
        reply = peer.recv()
        assert isinstance(reply, Failed) and reply.kind == "PlanError", reply
        assert receiver.state == "empty" and receiver.version is None
        # the refusal ends that sync, not the connection: a good offer on it is accepted
        peer.send(small_offer(6))
        assert peer.recv() == Accept(6)
    finally:
        peer.close()
    assert wait_until(lambda: receiver.state == "empty"), "closing mid-sync returns to the previous state"
    assert_all_bit_exact(dest, before)
    assert_still_serves(receiver, dest)


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
def test_huge_tensor_claim_is_refused_before_allocating(transport):
    """A plan that covers a 1 TiB tensor piece by piece is well-formed; a receiver that would
    have to stage it refuses before allocating anything."""
    bucket = 1 << 28
    size = 1 << 40
    spec = TensorSpec("huge", "uint8", (size,), "uint8")
    plan = Plan(bucket, (spec,), tuple((Piece(0, i * bucket, 0, bucket),) for i in range(size // bucket)), size)
    sink = Recorder()
    with receiving(sink, transport, max_bucket_bytes=bucket) as receiver:
        peer = RawPeer(receiver.address)
        try:
            peer.hello()
            peer.send(Offer(1, plan, plan_id(plan)))
            reply = peer.recv()
        finally:
            peer.close()
    assert isinstance(reply, Failed) and reply.kind == "PlanError"
    assert "memory" in reply.message
    assert sink.calls == [("begin", 1), ("abort", 1)]  # the sink began, so it hears the sync is off


# --- tcp: a raw sync, byte for byte -------------------------------------------------------------


@pytest.fixture
def tcp_live():  # type: ignore[no-untyped-def]
    dest = {"w": torch.zeros(64), "v": torch.zeros(3, dtype=torch.int64)}
    sink = Recorder(dest)
    with receiving(sink, "tcp", timeout=WAIT_S) as receiver:
        yield receiver, dest, sink


@pytest.mark.parametrize("transport", PROCESS_TRANSPORTS)
@pytest.mark.parametrize("shape", [(2**62, 2**62, 0), (2**64 - 1, 0), (0, 2**63)])
def test_empty_tensor_with_overflowing_shape_is_refused(transport, shape):
    """Zero bytes, but a shape no tensor can have: refused in the plan check, not left to blow up
    in the receiver's connection thread when the tensor is staged."""
    spec = TensorSpec("x", "float32", shape, "float32")
    plan = Plan(64, (spec,), ((Piece(0, 0, 0, 0),),), 0)
    sink = Recorder()
    with receiving(sink, transport) as receiver:
        peer = RawPeer(receiver.address)
        try:
            peer.hello()
            peer.send(Offer(1, plan, plan_id(plan)))
            reply = peer.recv()
        finally:
            peer.close()
        assert isinstance(reply, Failed) and reply.kind == "PlanError", reply
        assert receiver.state == "empty"
    assert sink.calls == []


@pytest.mark.fault(
    "a second push races the first",
    expected="the second sender is refused at once (NegotiationError: busy); the first sync is unaffected",
)
def test_receiver_busy_with_one_sender_refuses_another(tcp_live, observe):
    receiver, dest, sink = tcp_live
    peer = RawPeer(receiver.address)
    try:
        peer.hello()
        peer.send(small_offer(5))
        assert peer.recv() == Accept(5)
        assert receiver.state == "syncing"
        with sending(receiver.address, raise_on_failure=False) as sender:
            report = sender.push({"w": torch.ones(64), "v": torch.ones(3, dtype=torch.int64)}, version=9)
        assert [o.kind for o in report.failed] == ["NegotiationError"]
        assert "busy" in report.failed[0].error
    finally:
        peer.close()
    # the raw sender vanished mid-sync (before any bucket): the receiver aborts and is free again
    assert wait_until(lambda: receiver.state == "empty")
    assert "version 5" in receiver.last_error
    assert [version for version, _ in sink.aborts] == [5]
    assert_still_serves(receiver, dest)
    observe(
        f"second push: {report.failed[0].kind} (`{report.failed[0].error[:70]}`) in {report.seconds:.2f} s; "
        "when the first sender vanished the receiver aborted version 5 and the next push committed"
    )


def _payload(offer: Offer, w: torch.Tensor, v: torch.Tensor) -> list[tuple[BucketData, bytes]]:
    whole = [w.numpy().tobytes(), v.numpy().tobytes()]
    out = []
    for index, bucket in enumerate(offer.plan.buckets):
        data = b"".join(whole[p.tensor][p.tensor_offset : p.tensor_offset + p.nbytes] for p in bucket)
        out.append((BucketData(index, len(data)), data))
    return out


def test_raw_tcp_sync_commits(tcp_live):
    receiver, dest, sink = tcp_live
    offer = small_offer(3)
    w, v = torch.randn(64), torch.tensor([4, 5, 6])
    peer = RawPeer(receiver.address)
    try:
        peer.hello()
        peer.send(offer)
        assert peer.recv() == Accept(3)
        for message, data in _payload(offer, w, v):
            peer.send(message)
            peer.sock.sendall(data)
        peer.send(Commit(3, offer.plan_id))
        reply = peer.recv()  # (its timings vary)
        assert isinstance(reply, Committed) and reply.version == 3
    finally:
        peer.close()
    assert receiver.version == 3 and receiver.state == "ready"
    assert_all_bit_exact(dest, {"w": w, "v": v})
    assert sink.hooks() == ["begin", "commit"]


@pytest.mark.parametrize(
    ("tamper", "kind"),
    [
        ("wrong-index", "ProtocolError"),
        ("wrong-nbytes", "ProtocolError"),
        ("frame-instead-of-bucket", "ProtocolError"),
        ("commit-digest", "PlanError"),
        ("commit-version", "PlanError"),
        ("no-commit", "ProtocolError"),
    ],
)
def test_raw_tcp_sync_tampered_is_refused(tcp_live, tamper, kind):
    receiver, dest, sink = tcp_live
    before = {k: t.clone() for k, t in dest.items()}
    offer = small_offer(3)
    payload = _payload(offer, torch.randn(64), torch.tensor([4, 5, 6]))
    peer = RawPeer(receiver.address)
    try:
        peer.hello()
        peer.send(offer)
        assert peer.recv() == Accept(3)
        first, _ = payload[0]
        if tamper == "wrong-index":
            peer.send(BucketData(1, first.nbytes))
        elif tamper == "wrong-nbytes":
            peer.send(BucketData(0, first.nbytes + 1))
        elif tamper == "frame-instead-of-bucket":
            peer.send(Accept(3))
        else:
            for message, data in payload:
                peer.send(message)
                peer.sock.sendall(data)
            if tamper == "commit-digest":
                peer.send(Commit(3, "0" * 32))
            elif tamper == "commit-version":
                peer.send(Commit(4, offer.plan_id))
            else:
                peer.send(Hello(PROTOCOL_VERSION, "again"))
        reply = peer.recv()
        assert isinstance(reply, Failed) and reply.kind == kind, reply
        assert reply.version == 3
    finally:
        peer.close()
    assert sink.aborts and sink.aborts[0][0] == 3
    assert receiver.version is None
    if tamper.startswith("commit") or tamper == "no-commit":
        # every bucket had landed in the live tensors: never claim a version, say it is dirty
        assert receiver.state == "dirty"
    else:
        assert receiver.state == "empty"
        assert_all_bit_exact(dest, before)
    assert "version 3" in receiver.last_error
    assert_still_serves(receiver, dest)


# --- shm: a hostile ring --------------------------------------------------------------------------


@pytest.fixture
def shm_live():  # type: ignore[no-untyped-def]
    dest = {"w": torch.zeros(64), "v": torch.zeros(3, dtype=torch.int64)}
    with receiving(dest, "shm", timeout=WAIT_S, max_bucket_bytes=4096) as receiver:
        yield receiver, dest


@pytest.mark.parametrize(
    "ring",
    [
        Ring(("../../etc/passwd",), 4096),
        Ring(("/etc/passwd",), 4096),
        Ring(("weightsync-1-zzzzzzzzzzzz-0",), 4096),
        Ring(("weightsync-1-0123456789ab-0",), 4096),  # well-named, does not exist
        Ring(("weightsync-1-0123456789ab-0",), 1 << 40),
        Ring(("weightsync-1-0123456789ab-0",), 0),
        Ring(tuple(f"weightsync-1-0123456789ab-{i}" for i in range(17)), 64),
        Ring((), 64),
    ],
    ids=["traversal", "absolute", "bad-token", "missing", "too-big", "zero", "too-many", "none"],
)
def test_hostile_ring_is_refused(shm_live, ring):
    receiver, dest = shm_live
    peer = RawPeer(receiver.address)
    try:
        peer.hello()
        peer.send(ring)
        assert peer.closed_by_receiver()
    finally:
        peer.close()
    assert_still_serves(receiver, dest)


def test_ring_segment_of_the_wrong_size_is_refused(shm_live):
    receiver, dest = shm_live
    name = f"weightsync-{os.getpid()}-0123456789ab-0"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(b"\x00" * 128)
    try:
        peer = RawPeer(receiver.address)
        try:
            peer.hello()
            peer.send(Ring((name,), 4096))
            assert peer.closed_by_receiver()
        finally:
            peer.close()
    finally:
        os.unlink(path)
    assert_still_serves(receiver, dest)


def test_bucket_in_a_slot_never_mapped_is_refused(shm_live):
    receiver, dest = shm_live
    before = {k: t.clone() for k, t in dest.items()}
    peer = RawPeer(receiver.address)
    try:
        peer.hello()
        peer.send(small_offer(2))
        assert peer.recv() == Accept(2)  # no ring was sent: nothing is mapped
        peer.send(BucketReady(0, 0))
        reply = peer.recv()
        assert isinstance(reply, Failed) and reply.kind == "ProtocolError"
        assert "not mapped" in reply.message
    finally:
        peer.close()
    assert receiver.state == "empty"
    assert_all_bit_exact(dest, before)
    assert_still_serves(receiver, dest)


# --- a hostile receiver against a real sender ---------------------------------------------------


class FakeReceiver:
    """A tcp listener that answers one sender connection with a scripted (mis)behaviour."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="fake-receiver")
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        conn = Connection(sock, "fake")
        try:
            self._play(conn, sock)  # returns early to hang up
        except Exception:  # the sender hanging up on us is the point of most scripts
            pass
        finally:
            sock.close()

    def _play(self, conn: Connection, sock: socket.socket) -> None:
        welcome = Welcome(PROTOCOL_VERSION, "fake", 1 << 20, None)
        conn.recv(WAIT_S)  # Hello
        if self.script == "close-at-once":
            return
        if self.script == "garbage":
            sock.sendall(HEADER.pack(5) + b"\xc1" * 5)
        elif self.script == "huge-header":
            sock.sendall(HEADER.pack(2**32 - 1))
        elif self.script == "pickle":
            sock.sendall(HEADER.pack(len(PICKLED)) + PICKLED)
        elif self.script == "wrong-protocol":
            conn.send(Welcome(PROTOCOL_VERSION + 1, "fake", 1 << 20, None), WAIT_S)
        elif self.script == "no-room":
            conn.send(Welcome(PROTOCOL_VERSION, "fake", 0, None), WAIT_S)
        elif self.script == "negative-room":
            conn.send(Welcome(PROTOCOL_VERSION, "fake", -(2**63), None), WAIT_S)
        elif self.script == "hello-back":
            conn.send(Hello(PROTOCOL_VERSION, "fake"), WAIT_S)
        elif self.script == "silent":
            pass
        else:
            conn.send(welcome, WAIT_S)
            offer = conn.recv(WAIT_S)
            assert isinstance(offer, Offer)
            if self.script == "fails-offer":
                conn.send(Failed(offer.version, "PlanError", "no such tensor here"), WAIT_S)
            elif self.script == "accept-then-vanish":
                conn.send(Accept(offer.version), WAIT_S)
                return
        self.done.wait(WAIT_S)

    def close(self) -> None:
        self.done.set()
        self.thread.join(WAIT_S)
        self.listener.close()


@pytest.mark.parametrize(
    ("script", "kind"),
    [
        ("close-at-once", "PeerClosedError"),
        ("garbage", "ProtocolError"),
        ("huge-header", "ProtocolError"),
        ("pickle", "ProtocolError"),
        ("wrong-protocol", "ProtocolError"),
        ("no-room", "NegotiationError"),
        ("negative-room", "NegotiationError"),
        ("hello-back", "ProtocolError"),
        ("silent", "TransferTimeout"),
        ("silent-after-offer", "TransferTimeout"),
        ("fails-offer", "PlanError"),
        ("accept-then-vanish", "PeerClosedError"),
    ],
)
def test_misbehaving_receiver_fails_alone(script, kind):
    """Everything the sender reads from a receiver is checked; a receiver that lies, stalls or
    hangs up is failed with a precise kind, and the honest receiver beside it commits."""
    fake = FakeReceiver(script)
    dest = {"w": torch.zeros(64)}
    try:
        with (
            receiving(dest, "tcp") as honest,
            sending([fake.address, honest.address], timeout=0.5, raise_on_failure=False) as sender,
        ):
            report = sender.push({"w": torch.ones(64)}, version=1)
            assert [(o.address, o.kind) for o in report.failed] == [(fake.address, kind)], report.failed
            assert honest.version == 1 and torch.equal(dest["w"], torch.ones(64))
            if script == "fails-offer":
                assert report.failed[0].error == "no such tensor here"
    finally:
        fake.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
    return client, accepted


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_closed_by_peer_sees_the_other_end_go_without_reading_or_waiting(kind):
    ours, theirs = _tcp_pair() if kind == "tcp" else socket.socketpair()
    ours.settimeout(30.0)  # a timed socket must not make the check wait
    conn = Connection(ours, kind)
    try:
        assert not conn.closed_by_peer()
        theirs.sendall(b"late ack")
        assert not conn.closed_by_peer(), "unread data is not a close"
        theirs.close()
        if kind == "tcp":
            assert wait_until(conn.closed_by_peer), "TCP: the state says closed even with data unread"
            assert ours.recv(64) == b"late ack", "the check consumed nothing"
        else:
            assert not conn.closed_by_peer(), "Unix: the EOF shows only once the data before it is read"
            assert ours.recv(64) == b"late ack"
            assert conn.closed_by_peer()
        assert ours.recv(64) == b"", "the check consumed nothing: the EOF is still there to read"
    finally:
        conn.close()
        theirs.close()
    assert conn.closed_by_peer(), "a connection we closed ourselves counts as closed"
