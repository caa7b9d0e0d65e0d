"""The options of each end, as values: frozen, keyword-only, validated once when built.

`WeightSender(addresses, **kwargs)` and `WeightReceiver(sink, transport, **kwargs)` build these
from their keyword arguments; the relay, the fleet, the server and the CLI build them once and
pass them on as they are (`WeightSender(addresses, options=SenderOptions(...))`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias, TypeVar

import torch

from weightsync.auth import resolve_token
from weightsync.checksum import Verify, check_verify
from weightsync.errors import ConfigError
from weightsync.sizing import ALIGN_BYTES, DEFAULT_MEMORY_BUDGET_BYTES, align_down, parse_bucket_bytes

__all__ = ["ReceiverOptions", "SenderOptions", "build_options"]

OptionsT = TypeVar("OptionsT", "SenderOptions", "ReceiverOptions")

Delta: TypeAlias = bool | Literal["all"]
"""Who gets only what changed: nobody, receivers on network transports, or every receiver."""

DEFAULT_TIMEOUT_S = 60.0
"""The bound on any single wait, on either side, unless given."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SenderOptions:
    """How a `WeightSender` pushes (see its docstring for each field)."""

    bucket_bytes: int | str = "auto"
    min_bucket_bytes: int = ALIGN_BYTES
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    cast: torch.dtype | Mapping[str, torch.dtype] | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    num_slots: int = 2
    raise_on_failure: bool = True
    """`push` raises `SyncFailed` when a receiver did not commit; False returns the report instead,
    for a caller that handles each receiver's outcome itself."""
    verify: Verify = "off"
    auth_token: str | None = None
    """The shared token; None takes $WEIGHTSYNC_AUTH_TOKEN (resolved once, here)."""
    delta: Delta = False
    """Send receivers that hold the previous push only what changed (docs/delta.md): True, those
    reached over a network transport (tcp, collective, nixl); "all", over every transport. Costs
    one host copy of the model in the wire dtype; a push some receiver may take as a patch is
    verified at least as "bucket", any other as `verify` says."""
    allow_older_version: bool = False
    """Receivers take a version at or below the last one they committed, which they refuse
    otherwise (versions only go forward): to move them back on purpose."""

    def __post_init__(self) -> None:
        check_timeout(self.timeout)
        if not any(self.delta is choice for choice in (False, True)) and self.delta != "all":
            raise ConfigError(f"delta must be True, False or 'all', got {self.delta!r}")
        if (
            isinstance(self.min_bucket_bytes, bool)
            or not isinstance(self.min_bucket_bytes, int)
            or self.min_bucket_bytes < 1
        ):
            raise ConfigError(f"min_bucket_bytes must be a positive integer, got {self.min_bucket_bytes!r}")
        _check_budget(self.memory_budget_bytes)
        parse_bucket_bytes(self.bucket_bytes)
        object.__setattr__(self, "timeout", float(self.timeout))
        object.__setattr__(self, "verify", check_verify(self.verify))
        object.__setattr__(self, "auth_token", resolve_token(self.auth_token))

    @property
    def proposed_bucket_bytes(self) -> int | None:
        """The bucket size to propose, or None for "auto"."""
        return parse_bucket_bytes(self.bucket_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReceiverOptions:
    """How a `WeightReceiver` listens and what it accepts (see its docstring for each field)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_bucket_bytes: int | str = "auto"
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    timeout: float = DEFAULT_TIMEOUT_S
    verify: Verify = "off"
    auth_token: str | None = None
    """The shared token; None takes $WEIGHTSYNC_AUTH_TOKEN (resolved once, here)."""

    def __post_init__(self) -> None:
        check_timeout(self.timeout)
        _check_budget(self.memory_budget_bytes)
        parse_bucket_bytes(self.max_bucket_bytes, "max_bucket_bytes")
        object.__setattr__(self, "timeout", float(self.timeout))
        object.__setattr__(self, "verify", check_verify(self.verify))
        object.__setattr__(self, "auth_token", resolve_token(self.auth_token))

    def without_token(self) -> dict[str, Any]:
        """These options as JSON for another process, the token left out (each process takes
        its own from $WEIGHTSYNC_AUTH_TOKEN: no secret travels)."""
        return {
            field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "auth_token"
        }

    @property
    def bucket_limit(self) -> int:
        """The largest bucket accepted: `max_bucket_bytes`, or half the memory budget for "auto"."""
        return parse_bucket_bytes(self.max_bucket_bytes, "max_bucket_bytes") or align_down(
            self.memory_budget_bytes // 2
        )


def check_timeout(timeout: object) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _check_budget(budget: object) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 128:
        raise ConfigError(f"memory_budget_bytes must be an integer >= 128, got {budget!r}")


def build_options(cls: type[OptionsT], options: OptionsT | None, kwargs: Mapping[str, Any]) -> OptionsT:
    """`options` as given, or built from keyword arguments (not both)."""
    if options is not None:
        if kwargs:
            raise ConfigError(f"give options= or keyword arguments, not both (got {sorted(kwargs)})")
        if not isinstance(options, cls):
            raise ConfigError(f"options must be a {cls.__name__}, got {type(options).__name__}")
        return options
    known = [field.name for field in dataclasses.fields(cls)]
    unknown = set(kwargs) - set(known)
    if unknown:
        raise ConfigError(f"unknown option(s) {sorted(unknown)}; expected some of {known}")
    return cls(**kwargs)
