"""A shared token: each side proves it holds it (HMAC of the other's nonce), the token never
crosses the wire, and a receiver refuses to listen beyond loopback without one."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import receiving, sending
from weightsync import ConfigError, WeightReceiver, wire
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
    ("receiver_token", "sender_token", "says"),
    [
        (TOKEN, None, "the sender did not prove it holds this receiver's auth token"),
        (TOKEN, OTHER, "did not prove it holds our auth token"),
        (None, TOKEN, "did not prove it holds our auth token"),
    ],
    ids=["sender-without", "wrong-token", "receiver-without"],
)
def test_a_missing_or_wrong_token_is_refused(transport, receiver_token, sender_token, says) -> None:
    dest = {"w": torch.zeros(64)}
    with (
        receiving(dest, transport, auth_token=receiver_token) as receiver,
        sending(receiver.address, auth_token=sender_token, raise_on_failure=False) as sender,
    ):
        report = sender.push(weights(), 1)
        assert not report.ok
        assert report.failed[0].kind == "AuthError" and says in report.failed[0].error, report.failed[0]
        assert receiver.version is None and receiver.state == "empty"
    assert not dest["w"].any()


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
        WeightReceiver({}, "tcp", host="0.0.0.0")
    WeightReceiver({}, "tcp", host="0.0.0.0", auth_token=TOKEN).close()
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # or from the environment
    WeightReceiver({}, "tcp", host="0.0.0.0").close()


def test_the_environment_supplies_the_token_to_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with receiving({"w": torch.zeros(64)}, "shm") as receiver, sending(receiver.address) as sender:
        assert sender.push(weights(), 1).ok
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        WeightReceiver({}, "shm")


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
