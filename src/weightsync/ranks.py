"""The trainer's ranks agreeing on one sharded push: the `weightsync.round.Agreement` of a
sharded round (vLLM's trainer API, `SGLangEngine(sharded=True)`).

Every rank pushes its own part (weightsync's sharded sync), but only rank 0 talks to the engine
(the update window, the version label). The ranks agree over a gloo group of their own, made once
by every rank in `trainer_init` (vLLM) or the engine's constructor (SGLang); for vLLM::

    rank 0                                   every rank
    rendezvous: the workers' addresses  -->  share(): the same addresses (msgspec JSON bytes)
                                             settle(ok): did every rank connect? (all or none)
    start_weight_update                 -->  settle(ok): did the window open?
    update_weights, beside its own push      push its part
                                             settle(ok): did every rank commit and vLLM land it?
    finish: label, keep or not ready    -->  wait(): every rank returns, or raises, alike

No pickle: what is shared is bytes in a uint8 tensor. Every agreement is bounded by the group's
timeout: a rank that died, or that does not get there in time, makes it raise `CollectiveError`
on the ranks that did, instead of waiting out torch.distributed's default of 30 minutes.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from weightsync.errors import CollectiveError, ConfigError, one_line

__all__ = ["Exchange", "Ranks"]


class Ranks:
    """The trainer's ranks (torch.distributed's default group must be up on every rank).

    Args:
        timeout: seconds each agreement may wait for the last rank to get there.
        members: the ranks (of the default group) that agree; default: every rank. Every rank
            of the default group makes it, at the same point (`torch.distributed.new_group`).

    Raises:
        ConfigError: torch.distributed is not initialised.
    """

    def __init__(self, timeout: float, members: list[int] | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("a sharded push from several trainer ranks needs torch.distributed initialised")
        self.timeout = timeout
        self.group = dist.new_group(members, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.leads = self.rank == 0
        """Rank 0 drives the engine's window (`weightsync.round.Agreement`)."""

    def share(self, data: bytes) -> bytes:
        """Rank 0's `data`, on every rank (the others pass anything)."""
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self._together("share rank 0's bytes", lambda: dist.broadcast(size, src=0, group=self.group))
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 and data else None
        if buffer is None:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        if buffer.numel():
            self._together("share rank 0's bytes", lambda: dist.broadcast(buffer, src=0, group=self.group))
        return buffer.numpy().tobytes()

    def settle(self, ok: bool) -> bool:
        """Whether every rank says `ok`."""
        vote = torch.tensor([1 if ok else 0], dtype=torch.int64)
        self._together("agree", lambda: dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.group))
        return bool(vote.item())

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (as many on each), in rank order."""
        mine = torch.tensor(values, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        self._together("exchange their patch sizes", lambda: dist.all_gather(every, mine, group=self.group))
        return [tensor.tolist() for tensor in every]

    def wait(self) -> None:
        """Until every rank got here."""
        self._together("meet", lambda: dist.barrier(group=self.group))

    def _together(self, what: str, collective: Callable[[], object]) -> None:
        """Run `collective` on this rank.

        Raises:
            CollectiveError: another rank died, or did not get there within the timeout.
        """
        try:
            collective()
        except RuntimeError as exc:  # torch.distributed's errors, a gloo timeout among them
            raise CollectiveError(
                f"trainer rank {self.rank} of {self.world}: the ranks could not {what} (a rank died, or did not get "
                f"there within {self.timeout:g} s): {one_line(exc)}"
            ) from exc


class Exchange:
    """`source.Exchanges` for a sharded source: every pushing rank's integers, over a gloo group
    of `members` (default: every rank) made at the first exchange, by every rank at once."""

    def __init__(self, members: list[int] | None = None) -> None:
        self._members = members
        self._ranks: Ranks | None = None

    def __call__(self, values: list[int], timeout: float) -> list[list[int]]:
        if self._ranks is None:
            self._ranks = Ranks(timeout, self._members)
        return self._ranks.exchange(values)
