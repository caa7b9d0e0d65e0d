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

One round of `push(tensors, version)`, every phase at its call site::

    sender.connect()                                a worker that refuses the sender fails the
                                                    round before anything is paused
    pause_generation(mode)
    begin_weight_update
    update_weights_from_tensor(Land(version))  ||   every TP worker lands the version from its
    sender.push(tensors, version)                   receiver through SGLang's load_weights
    end_weight_update
    read every worker's Landing from the store
    update_weight_version(version)                  only when every worker landed it whole
    continue_generation
    check /model_info's weight_version

A round that fails raises (`SyncFailed` for a push some worker did not land, `ServerError` for
an SGLang route that failed) and labels nothing. The workers land a push only once it arrived
whole (worker.py), so a failed transfer leaves the previous version serving, labelled as it
was, and generation continues. If a worker's `load_weights` itself failed part way (its
`Landing` says the model was touched), the weights are mixed: generation stays paused (SGLang
serves nothing rather than a mix) and the error says so; the next good push resumes it.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from weightsync.errors import ConfigError, ConnectError, ServerError, SyncFailed, WeightSyncError, one_line
from weightsync.integrations.sglang.client import PauseMode, SGLangClient
from weightsync.integrations.sglang.control import Land, Landing, payload, read_landings
from weightsync.options import ReceiverOptions, SenderOptions
from weightsync.report import SyncReport
from weightsync.sender import WeightSender
from weightsync.workers.rendezvous import WorkerAddress, collect, open_store
from weightsync.workers.start import Start

__all__ = ["LOADER", "SGLangEngine"]

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
        options: the sender's options (bucket size, cast, verification, timeout, token);
            `raise_on_failure` is not among them: a failed round always raises.
        pause_mode: how SGLang pauses generation for the round (`client.PauseMode`).
        receiver_host: where each worker's receiver listens (networked transports).
        receiver_port: the first TP worker's port (rank r listens on port + r); 0: any.
        rendezvous_host: where the trainer's store listens (loopback unless the server runs on
            another host; then the trainer's address that host reaches).
        deadline: seconds a whole round may take (each worker waits this long for the push).
        api_key: SGLang's `--api-key`, if it was started with one.

    Raises:
        ConfigError: a bad argument.
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
        self._store: Any = None
        self._session = ""
        self._sender: WeightSender | None = None

    def connect(self) -> list[WorkerAddress]:
        """Start a receiver in every TP worker and connect a sender to all of them.

        Raises:
            ServerError: SGLang refused a call (was it started with weightsync's loader?).
            ConnectError: not every TP worker announced a receiver.
            ResourceError: the store could not listen on `rendezvous_host`.
        """
        self._drop_sender()
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
        self.workers = sorted(workers, key=lambda worker: worker.rank)
        self._sender = WeightSender([worker.address for worker in self.workers], options=self.options)
        log.info("weightsync: %d SGLang TP worker(s) over %s", num_ranks, self.transport)
        return self.workers

    def push(self, tensors: Any, version: int) -> SyncReport:
        """Push `tensors` (a mapping, (name, tensor) pairs or a `WeightSource`, in the
        checkpoint's names) into every TP worker and label them `version` in SGLang.

        Raises:
            ConfigError: `version` is not an integer above the last one labelled.
            SyncFailed: the push failed (the source raised, a worker refused it or did not land
                it whole); nothing was labelled. The message says whether the previous weights
                serve (generation goes on), or generation stays paused (a worker's weights are
                mixed, or no worker said how it went); `.report` is the push's report, or None
                when the push itself raised.
            ServerError: an SGLang route failed; nothing was labelled.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {version!r}")
        if self.version is not None and version <= self.version:
            raise ConfigError(f"version must be above the last one labelled ({self.version}), got {version}")
        if self._sender is None:
            self.connect()
        sender = self._require()
        refused = sender.connect()
        if refused:
            causes = "; ".join(f"{address}: {one_line(error)}" for address, error in refused.items())
            raise ConnectError(f"version {version} not pushed: a TP worker's receiver refused the sender: {causes}")

        self.client.pause(self.pause_mode)
        try:
            report, landings, why = self._round(sender, tensors, version)
        except BaseException:
            self.client.resume()  # an SGLang route failed, or an interrupt: the caller sees why
            raise
        if report is not None:
            why = [outcome.cause() for outcome in report.failed] + why
        why += [f"TP rank {landing.rank}: {landing.error}" for landing in landings if not landing.landed]
        if not why:
            try:
                self.client.label(str(version))
            except ServerError as exc:  # new weights under the old label: serve nothing instead
                raise ServerError(
                    exc.status,
                    f"version {version} landed but SGLang refused its label (generation stays paused): {exc}",
                ) from exc
            self.client.resume()
            self._check_label(version)
            self.version = version
            assert report is not None
            return report
        unsure = [landing.rank for landing in landings if landing.touched and not landing.landed]
        if landings and not unsure:
            self.client.resume()
            state = "the previous weights serve, labelled as before"
        elif unsure:
            state = f"the weights of TP rank(s) {unsure} are mixed: SGLang's generation stays paused until a push lands"
        else:
            state = "no worker said how it went: SGLang's generation stays paused until a push lands"
        raise SyncFailed(f"version {version} was not labelled ({state}): " + "; ".join(why), report)

    def _round(
        self, sender: WeightSender, tensors: Any, version: int
    ) -> tuple[SyncReport | None, list[Landing], list[str]]:
        """Inside SGLang's update session, the update call and the push side by side; returns
        the push's report (None if it raised), every worker's landing ([] if some worker wrote
        none) and what else went wrong."""
        why = []
        report = None
        land = Land(version=version, session=self._session, timeout=self.deadline)
        self.client.begin_update()
        pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-sglang-update")
        try:
            update = pool.submit(self._update, land, len(self.workers), flush_cache=self.pause_mode != "in_place")
            try:
                report = sender.push(tensors, version, deadline=self.deadline)
            except Exception as exc:  # the workers heard that the sender gave up: they return
                why.append(f"the push failed: {one_line(exc)}")
            failed = _error_of(update, self.deadline + HTTP_MARGIN_S)
            if failed is not None:
                why.append(f"SGLang's update call: {one_line(failed)}")
        finally:
            pool.shutdown(wait=False)  # never join a control-plane thread on the error path
        self.client.end_update()
        ranks = [worker.rank for worker in self.workers]
        try:
            landings = read_landings(self._store, self._session, version, ranks, HTTP_MARGIN_S)
        except WeightSyncError as exc:
            return report, [], [*why, one_line(exc)]
        return report, landings, why

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


def _new_session() -> str:
    import secrets

    return secrets.token_hex(8)


def _error_of(future: Future[None], timeout: float) -> BaseException | None:
    """What `future` raised (None: it returned), or a TimeoutError once `timeout` passed."""
    try:
        return future.exception(timeout=timeout)
    except TimeoutError:
        return TimeoutError(f"no answer within {timeout:g} s")
