"""The trainer half: `SGLangEngine`, one call per training step that runs a whole round into a
stock SGLang server over weightsync's transports.

::

    from weightsync.integrations.sglang import SGLangEngine

    with SGLangEngine("http://127.0.0.1:30000", transport="shm") as engine:
        for step in ...:
            ...                                     # train
            engine.push(model.state_dict(), version=step)

`connect()` (the first `push` calls it) starts every TP worker's receiver::

    end_weight_update                               only if a trainer that died left one open
    open_store(rendezvous_host)                     the trainer's store, for the engine's life
    update_weights_from_tensor(Start)               inside begin/end_weight_update: every TP
                                                    worker starts a receiver and announces it
    collect(store)                                  one address per TP rank, or ConnectError

Each `push(tensors, version)` is one round of `weightsync.round.run_round` (its phases at its
call site there; the same round as vLLM's trainer API) through `SGLangWindow`::

    pause_generation(mode); begin_weight_update
    update_weights_from_tensor(Land(version))  ||   every TP worker lands the version from its
    sender.push(tensors, version)                   receiver through SGLang's load_weights
    end_weight_update; every worker's LandResult from the store
    update_weight_version(version)                  only when every worker landed it whole
    continue_generation; check /model_info's weight_version

Sharded (`SGLangEngine(url, sharded=True)` on every rank of a trainer whose ranks each hold a
part, e.g. Megatron-Core's with a `MegatronSource`): every rank builds the engine and calls
`push` with its own source, and every rank pushes the part it holds, straight to the TP workers
(no rank gathers a tensor). Rank 0 alone drives SGLang (the connect, the window, the label) and
shares the workers' addresses; the ranks agree at each phase of the same round over a gloo group
of their own (weightsync/ranks.py, the round's `Agreement`), so that they all return, or all
raise, and a version is labelled only when every rank's part landed on every worker.

A failed round follows the one rule of docs/failure-semantics.md and raises `SyncFailed`. The
workers land a push only once it arrived whole (worker.py), so a failed transfer leaves the
previous version serving, labelled as it was, and generation continues. If a worker's
`load_weights` itself failed part way (its `LandResult` says the model was touched), no worker
said how it went, or SGLang refused the label, SGLang is not ready: it reports the weight
version `NOT_READY` and generation stays paused until a push lands.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from types import TracebackType
from typing import Any

import msgspec

from weightsync.errors import ConfigError, ConnectError, ServerError, WeightSyncError, one_line
from weightsync.integrations.sglang.client import PauseMode, SGLangClient
from weightsync.integrations.sglang.control import Land, LandResult, payload, read_results
from weightsync.options import ReceiverOptions, SenderOptions
from weightsync.ranks import Ranks
from weightsync.report import SyncReport
from weightsync.round import NOT_READY, SOLO, Outcome, WorkerState, run_round
from weightsync.sender import WeightSender
from weightsync.source import as_source
from weightsync.workers.rendezvous import WorkerAddress, collect, open_store
from weightsync.workers.start import Start

__all__ = ["LOADER", "SGLangEngine", "SGLangWindow"]

log = logging.getLogger(__name__)

LOADER = "weightsync.integrations.sglang.load_weights"
"""The loader SGLang is started with: `--custom-weight-loader weightsync.integrations.sglang.load_weights`."""

HTTP_MARGIN_S = 30.0
"""Seconds SGLang's update call may outlast the push's own timeout (the HTTP round trip, SGLang's
scheduler queue)."""


class SGLangEngine:
    """A stock SGLang server, started with weightsync's loader, as the target of weightsync pushes.

    Args:
        url: the server, e.g. "http://127.0.0.1:30000".
        transport: how the bytes travel: "shm" (same host; one ring read by every TP worker),
            "tcp", "collective" or "nixl" (any host).
        options: the sender's options (bucket size, cast, verification, timeout, token,
            `allow_older_version`);
            `raise_on_failure` is not among them: a failed round always raises.
        pause_mode: how SGLang pauses generation for the round (`client.PauseMode`).
        receiver_host: where each worker's receiver listens (networked transports).
        receiver_port: the first TP worker's port (rank r listens on port + r); 0: any.
        rendezvous_host: where the trainer's store listens (loopback unless the server runs on
            another host; then the trainer's address that host reaches).
        deadline: seconds a whole round may take (each worker waits this long for the push).
        api_key: SGLang's `--api-key`, if it was started with one.
        sharded: every trainer rank builds this engine and pushes the part it holds (module
            docstring); torch.distributed must be up on every rank. False: one trainer process
            pushes whole tensors.

    Raises:
        ConfigError: a bad argument; sharded without torch.distributed.
    """

    def __init__(
        self,
        url: str,
        *,
        transport: str = "shm",
        options: SenderOptions | None = None,
        pause_mode: PauseMode = "abort",
        receiver_host: str = "127.0.0.1",
        receiver_port: int = 0,
        rendezvous_host: str = "127.0.0.1",
        deadline: float = 600.0,
        api_key: str | None = None,
        sharded: bool = False,
    ) -> None:
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"pause_mode must be 'abort', 'retract' or 'in_place', got {pause_mode!r}")
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0:
            raise ConfigError(f"deadline must be a positive number of seconds, got {deadline!r}")
        self.options = dataclasses.replace(options or SenderOptions(), raise_on_failure=False)
        self.transport = transport
        self.pause_mode: PauseMode = pause_mode
        self.receiver_host = receiver_host
        self.receiver_port = receiver_port
        self.rendezvous_host = rendezvous_host
        self.deadline = float(deadline)
        self.client = SGLangClient(url, timeout=self.options.timeout + HTTP_MARGIN_S, api_key=api_key)
        self.workers: list[WorkerAddress] = []
        """Every TP worker's receiver, as it announced itself (empty until `connect`)."""
        self.version: int | None = None
        """The last version this engine labelled in SGLang (None: none yet)."""
        self.ready = True
        """SGLang serves an intact version (False: a round left its weights mixed; generation
        stays paused until a push lands)."""
        self.ranks = Ranks(self.options.timeout + HTTP_MARGIN_S) if sharded else None
        """Sharded: the trainer's ranks, which every push is agreed with (None: one process)."""
        self._store: Any = None
        self._session = ""
        self._sender: WeightSender | None = None

    def connect(self) -> list[WorkerAddress]:
        """Start a receiver in every TP worker and connect a sender to all of them (sharded:
        rank 0 starts them and shares their addresses; every rank calls this, or `push`).

        Raises:
            ServerError: SGLang refused a call (was it started with weightsync's loader?).
            ConnectError: not every TP worker announced a receiver (sharded: on every rank).
            ResourceError: the store could not listen on `rendezvous_host`.
            CollectiveError: sharded, another trainer rank died or did not get here in time.
        """
        self._drop_sender()
        if self.ranks is None:
            self.workers = self._start_workers()
        else:
            self.workers = self._shared_workers(self.ranks)
        self._sender = WeightSender([worker.address for worker in self.workers], options=self.options)
        log.info("weightsync: %d SGLang TP worker(s) over %s", len(self.workers), self.transport)
        return self.workers

    def _shared_workers(self, ranks: Ranks) -> list[WorkerAddress]:
        """Rank 0's workers, on every rank (rank 0 starts them).

        Raises:
            ConnectError: rank 0 could not start them (rank 0 raises its own error).
        """
        found: list[WorkerAddress] = []
        try:
            if ranks.leads:
                found = self._start_workers()
        finally:  # the other ranks wait for these bytes: they get them, or none, whatever happened
            shared = ranks.share(msgspec.json.encode(found) if found else b"")
        if not shared:
            raise ConnectError("no SGLang TP worker announced its receiver (trainer rank 0 could not reach them)")
        return msgspec.json.decode(shared, type=list[WorkerAddress])

    def _start_workers(self) -> list[WorkerAddress]:
        """Start every TP worker's receiver; their addresses, by rank."""
        num_ranks = int(self.client.server_info().get("tp_size", 1))
        if self.client.end_stale_update():
            # A trainer died inside a round. Generation stays as it left it: paused, when the
            # round had paused it, until a push lands (its weights may not be a version).
            log.warning("weightsync: ended an SGLang weight-update session left open")
        self._store, where = open_store(self.rendezvous_host, self.options.timeout)
        self._session = _new_session()
        message = Start(
            rendezvous=where,
            session=self._session,
            transport=self.transport,
            receiver=ReceiverOptions(
                host=self.receiver_host,
                port=self.receiver_port,
                verify=self.options.verify,
                timeout=self.options.timeout,
            ).without_token(),
        )
        self._update(message, num_ranks, flush_cache=False)
        workers = collect(self._store, self._session)
        if sorted(worker.rank for worker in workers) != list(range(num_ranks)):
            raise ConnectError(
                f"{len(workers)} of SGLang's {num_ranks} TP workers announced a receiver; was it started "
                f"with --custom-weight-loader {LOADER}? (SGLang's log names the worker's error)"
            )
        return sorted(workers, key=lambda worker: worker.rank)

    def push(self, tensors: Any, version: int) -> SyncReport:
        """Push `tensors` (a mapping, (name, tensor) pairs or a `WeightSource`, in the
        checkpoint's names) into every TP worker and label them `version` in SGLang.

        Raises:
            ConfigError: `version` is not an integer above the last one labelled (unless the
                options say `allow_older_version`; every worker's receiver refuses it too).
            SyncFailed: a worker refused the sender, or the round failed (the source raised, a
                worker refused the push or did not land it whole, an SGLang route failed inside
                the window); nothing was labelled. The message says whether the previous weights
                serve (generation goes on) or SGLang is not ready (module docstring); `.report`
                is the push's report, or None when the push itself raised.
            ServerError: pausing generation failed (nothing was opened).
            CollectiveError: sharded, another trainer rank died or did not get to this push
                in time; rank 0 decided the window all the same.
            Whatever the source's index raised (nothing was paused).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {version!r}")
        if self.version is not None and version <= self.version and not self.options.allow_older_version:
            raise ConfigError(
                f"version must be above the last one labelled ({self.version}), got {version} "
                "(allow_older_version=True in the options moves SGLang back)"
            )
        if self._sender is None:
            self.connect()
        sender = self._require()
        window = SGLangWindow(self, self.ready)
        try:
            report = run_round(
                sender,
                as_source(tensors),
                version,
                window,
                self.ranks if self.ranks is not None else SOLO,
                wait_s=self.deadline + HTTP_MARGIN_S,
                deadline=self.deadline,
            )
        finally:
            self.ready = window.ready
        self.version = version
        return report

    def _update(self, message: Start | Land, num_ranks: int, *, flush_cache: bool) -> None:
        """One update call carrying `message` to every TP worker, in an update session of its
        own for `Start`."""
        timeout = self.deadline + HTTP_MARGIN_S
        body = payload(message, num_ranks)
        if isinstance(message, Land):
            self.client.update_from_tensor(body, load_format=LOADER, flush_cache=flush_cache, timeout=timeout)
            return
        self.client.begin_update()
        try:
            self.client.update_from_tensor(body, load_format=LOADER, flush_cache=flush_cache, timeout=timeout)
        finally:
            self.client.end_update()

    def _check_label(self, version: int) -> None:
        served = self.client.weight_version()
        if served != str(version):
            raise ServerError(200, f"SGLang serves weight_version {served!r} after labelling {version}")

    def _require(self) -> WeightSender:
        if self._sender is None:
            raise ConnectError("not connected to SGLang's workers: call connect()")
        return self._sender

    def _drop_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()
        self._store = None  # its last reference: the store stops listening

    def close(self) -> None:
        """Close the sender and the store (the workers' receivers stay, until a next connect)."""
        self._drop_sender()
        self.client.close()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class SGLangWindow:
    """SGLang's update window for one round of `engine` (`weightsync.round.run_round`): generation
    paused for the round, SGLang's update session, and the update call carrying `Land` beside the
    push. Each TP worker lands a push only once it arrived whole and writes how it went (its
    `LandResult`), so a failed transfer leaves its weights intact; a `load_weights` that failed
    part way leaves them changed."""

    def __init__(self, engine: SGLangEngine, ready: bool) -> None:
        self.engine = engine
        self.client = engine.client
        self.ready = ready
        self.version = 0
        """The version this round lands (set as the window opens)."""

    def pause(self) -> None:
        self.client.pause(self.engine.pause_mode)

    def resume(self) -> None:
        self.client.resume()

    def start(self, version: int) -> None:
        self.version = version
        self.client.begin_update()

    def update(self, version: int) -> None:
        engine = self.engine
        land = Land(version=version, session=engine._session, timeout=engine.deadline)
        engine._update(land, len(engine.workers), flush_cache=engine.pause_mode != "in_place")

    def states(self, report: SyncReport | None) -> tuple[list[WorkerState], list[str]]:
        """The update session ends, then every worker's `LandResult` (none: nobody knows)."""
        engine = self.engine
        ranks = [worker.rank for worker in engine.workers]
        try:
            self.client.end_update()
            results = read_results(engine._store, engine._session, self.version, ranks, HTTP_MARGIN_S)
        except WeightSyncError as exc:
            return ["unknown"] * len(ranks), [one_line(exc)]
        why = [f"TP rank {result.rank}: {result.error}" for result in results if not result.landed]
        return [_state(result) for result in results], why

    def finish(self, version: int, outcome: Outcome) -> None:
        if outcome.verdict == "label":
            self.client.label(str(version))
            self.engine._check_label(version)
            self.ready = True
        elif not outcome.ready:
            self.ready = False
            try:  # generation stays paused: the label must not name a version it does not hold
                self.client.label(NOT_READY)
            except ServerError as exc:
                log.warning("SGLang refused the not-ready label: %s", exc)


def _state(result: LandResult) -> WorkerState:
    if result.landed:
        return "landed"
    return "changed" if result.touched else "intact"


def _new_session() -> str:
    return secrets.token_hex(8)
