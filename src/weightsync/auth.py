"""A shared token, proven without ever being sent: HMAC challenges for peers and a bearer check
for HTTP control endpoints.

Transport handshake (both directions, so neither side talks to an impostor):

    sender   Hello(..., nonce_s)                    ->
    receiver                                        <- Welcome(..., nonce_r, proof_r = HMAC(token, "receiver" | nonce_s))
    sender   Auth(proof_s = HMAC(token, "sender" | nonce_r))  ->   checked before any Ring or Offer

Nonces are fresh per connection, so a recorded proof is worth nothing on another connection.
The token itself never crosses the wire; traffic is not encrypted (see SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets

from weightsync.errors import ConfigError

__all__ = ["TOKEN_ENV", "check_bind", "new_nonce", "proof", "proof_matches", "resolve_token"]

TOKEN_ENV = "WEIGHTSYNC_AUTH_TOKEN"


def resolve_token(token: str | None) -> str | None:
    """The token given, else the one in $WEIGHTSYNC_AUTH_TOKEN, else None (no authentication)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    if token is not None and len(token) < 16:
        raise ConfigError(f"an auth token must have at least 16 characters (got {len(token)})")
    return token or None


def check_bind(host: str, token: str | None, what: str) -> None:
    """Refuse to listen beyond this host without a token."""
    if token is None and not _is_loopback(host):
        raise ConfigError(
            f"{what} would listen on {host!r}, reachable from other hosts, without an auth token: "
            f"set --auth-token or ${TOKEN_ENV} (or listen on 127.0.0.1)"
        )


def new_nonce() -> str:
    return secrets.token_hex(16)


def proof(token: str, role: str, nonce: str) -> str:
    """HMAC-SHA256 of the peer's nonce, bound to our role ("sender" or "receiver")."""
    return hmac.new(token.encode(), f"weightsync-auth/{role}/{nonce}".encode(), hashlib.sha256).hexdigest()


def proof_matches(token: str, role: str, nonce: str, given: str) -> bool:
    return hmac.compare_digest(proof(token, role, nonce), given)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere
