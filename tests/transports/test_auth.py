"""A shared token: each side proves it holds it (HMAC of the other's nonce), the token never
crosses the wire, and a receiver refuses to listen beyond loopback without one."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import receiving, sending, wait_until
from weightsync import AuthError, ConfigError, SyncFailed, WeightReceiver, wire
from weightsync.auth import TOKEN_ENV

TOKEN = "correct horse battery staple"
OTHER = "another token, also long enough"


def weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32)}


@pytest.mark.parametrize("transport", ["shm", "tcp", "collective"])
def test_the_same_token_on_both_sides_syncs(transport: str) -> None:
    dest = {"w": torch.zeros(64)}
    with receiving(dest, transport, auth_token=TOKEN) as receiver, sending(receiver.address, auth_token=TOKEN) as s:
        assert s.push(weights(), 1).ok
        assert s.push(weights(), 2).ok  # the authenticated connection is reused
    assert torch.equal(dest["w"], weights()["w"])


@pytest.mark.parametrize("transport", ["shm", "tcp", "collective"])
@pytest.mark.parametrize(
    ("receiver_token", "sender_token", "says", "logged"),
    [
        (TOKEN, None, "requires an auth token and this sender holds none", "this receiver requires an auth token"),
        (TOKEN, OTHER, "holds another auth token than this sender", "this receiver holds another auth token"),
        (None, TOKEN, "holds no auth token", "this receiver holds no auth token"),
    ],
    ids=["sender-without", "wrong-token", "receiver-without"],
)
def test_a_missing_or_wrong_token_is_refused(transport, receiver_token, sender_token, says, logged, caplog) -> None:
    """The push raises, saying the token was refused and where tokens come from; the receiver
    logs one warning line, which never holds a token."""
    dest = {"w": torch.zeros(64)}
    caplog.set_level(logging.INFO, logger="weightsync")
    with (
        receiving(dest, transport, auth_token=receiver_token) as receiver,
        sending(receiver.address, auth_token=sender_token) as sender,
    ):
        with pytest.raises(SyncFailed) as refused:
            sender.push(weights(), 1)
        assert receiver.version is None and receiver.state == "empty"
        assert wait_until(lambda: any(r.name == "weightsync.receiver" for r in caplog.records))
    message = str(refused.value)
    assert f"{receiver.address}: AuthError: auth token refused: " in message and says in message, message
    assert f"${TOKEN_ENV}" in message and "\n" not in message
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("closing connection from sender: auth token refused: "), warned
    assert logged in warned[0], warned
    assert all(TOKEN not in record.getMessage() and OTHER not in record.getMessage() for record in caplog.records)
    assert not dest["w"].any()


@pytest.mark.parametrize(
    ("receiver_token", "sender_token", "says"),
    [
        (TOKEN, None, "requires an auth token and this sender holds none"),
        (TOKEN, OTHER, "holds another auth token than this sender"),
        (None, TOKEN, "holds no auth token"),
    ],
    ids=["sender-without", "wrong-token", "receiver-without"],
)
def test_connect_tells_which_receivers_refuse_the_sender_before_any_push(
    receiver_token, sender_token, says, caplog, monkeypatch
) -> None:
    """A caller learns it before it starts anything the push would fill; the receiver logs why
    the sender left, and the same token on both sides connects."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="weightsync")
    with (
        receiving({"w": torch.zeros(64)}, "tcp", auth_token=receiver_token) as refusing,
        receiving({"w": torch.zeros(64)}, "tcp", auth_token=sender_token) as taking,
        sending([refusing.address, taking.address], auth_token=sender_token) as sender,
    ):
        refused = sender.connect()
        assert list(refused) == [refusing.address] and isinstance(refused[refusing.address], AuthError)
        assert says in str(refused[refusing.address]) and f"${TOKEN_ENV}" in str(refused[refusing.address])
        assert wait_until(lambda: any(r.name == "weightsync.receiver" for r in caplog.records))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("closing connection from sender: auth token refused: "), warned


def test_the_token_never_crosses_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    frames: list[bytes] = []
    encode = wire.encode
    monkeypatch.setattr(wire, "encode", lambda message: frames.append(encode(message)) or frames[-1])
    with receiving({"w": torch.zeros(64)}, "tcp", auth_token=TOKEN) as receiver:
        with sending(receiver.address, auth_token=TOKEN) as sender:
            assert sender.push(weights(), 1).ok
    assert len(frames) >= 6
    assert not any(TOKEN.encode() in frame for frame in frames)


def test_listening_beyond_loopback_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="without an auth token"):
        WeightReceiver({}, "tcp", host="0.0.0.0").start()
    WeightReceiver({}, "tcp", host="0.0.0.0", auth_token=TOKEN).close()
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # or from the environment
    WeightReceiver({}, "tcp", host="0.0.0.0").close()


def test_the_environment_supplies_the_token_to_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with receiving({"w": torch.zeros(64)}, "shm") as receiver, sending(receiver.address) as sender:
        assert sender.push(weights(), 1).ok
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        WeightReceiver({}, "shm").start()


@pytest.mark.parametrize("transport", ["tcp", "collective"])
@pytest.mark.parametrize("stage", ["hello", "auth"])
def test_a_stranger_cannot_make_a_protected_receiver_allocate_a_large_frame(transport, stage) -> None:
    """Before a sender has proven the token, frames are bounded at 64 KiB, not 64 MiB: the
    header of a larger one closes the connection before its body is read or allocated."""
    import struct

    from tests.unit.test_wire import RawPeer

    with receiving({"w": torch.zeros(64)}, transport, auth_token=TOKEN) as receiver:
        peer = RawPeer(receiver.address)
        try:
            if stage == "auth":
                peer.hello()
            peer.sock.sendall(struct.pack("!I", wire.HANDSHAKE_FRAME_BYTES + 1))
            assert peer.closed_by_receiver()
        finally:
            peer.close()
        # after proving the token, a large frame (a plan of 4000 tensors) is fine
        many = {f"layer.{i}.weight": torch.full((4,), float(i)) for i in range(4000)}
        dest = {name: torch.zeros(4) for name in many}
    with receiving(dest, transport, auth_token=TOKEN) as receiver, sending(receiver.address, auth_token=TOKEN) as s:
        report = s.push(many, 1)
        assert report.ok, report.failed
    assert torch.equal(dest["layer.3999.weight"], many["layer.3999.weight"])
