"""The engine loop: the one thread that touches the transformers engine.

HTTP handlers submit requests and get token events back through a callback. The loop has one
pause switch, as vLLM's engine has (`pause` / `resume`), in three modes:

    wait   stop admitting, finish the requests in flight, then park
    abort  stop admitting, abort the requests in flight (they end with finish_reason "abort"), park
    keep   stop admitting, freeze the requests in flight where they are, park; they continue on
           resume, with whatever weights are then loaded (their events carry each version)

Who holds it paused, and why, is the server's sync control's business (serving/control.py); the
loop only obeys. Every token event carries the weight version it was produced with (`set_version`,
called by the control when a sync commits), and the request's version spans so far: which output
tokens each version produced. Versions change only while the loop is parked, so the loop alone
knows each boundary exactly. Work that must not overlap a step (installing a LoRA adapter) runs
on the loop's thread between steps (`call`).

A request that fails ends with an event that says so (`error`, and the HTTP status it maps to:
400 for a request the engine refuses, 503 while the weights are not servable, 500 for an engine
that failed). A step that raises ends every request in it that way and counts as a failure;
`failed_steps` (consecutive) turns the server unhealthy, and the next good step clears it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable

from weightsync.errors import ConfigError, RequestError, ResourceError, SinkError
from weightsync.serving.config import PAUSE_MODES, PauseMode
from weightsync.serving.hf.base import SamplingParams, StepEngine, StepOutput

__all__ = ["EngineLoop", "TokenEvent", "VersionSpan"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class VersionSpan:
    """Output tokens `[start, end)` of one request were produced by weight `version` (vLLM's
    `WeightVersionSpan`, with an int version)."""

    version: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens of one request, and the weight version that produced them."""

    token_ids: list[int]
    logprobs: list[float] | None
    version: int | None
    finished: bool = False
    finish_reason: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    """Why the request failed (it is finished, with no output): never a finish_reason."""
    error_status: int = 500
    """The HTTP status `error` maps to: 400 refused, 503 weights not servable, 500 engine failure."""
    spans: tuple[VersionSpan, ...] = ()
    """Every output token of the request so far, by the version that produced it, in order: one
    span, or more after a keep-mode sync landed mid-request. Empty before the first token."""
    base_version: int | None = None
    """For a request run with a LoRA adapter (whose version is `version`, and the spans'): the
    base weights' version under it; None for a request on the base weights alone."""


def failure(exc: BaseException, version: int | None) -> TokenEvent:
    """The event that ends a request the engine refused or failed on."""
    status = 400 if isinstance(exc, RequestError) else 503 if isinstance(exc, SinkError) else 500
    message = str(exc) if status == 400 else f"the engine failed: {exc}"
    return TokenEvent([], None, version, True, "error", error=message, error_status=status)


Deliver = Callable[[TokenEvent], None]


@dataclasses.dataclass(slots=True)
class _Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deliver: Deliver
    spans: tuple[VersionSpan, ...] = ()

    def record(self, version: int | None, count: int) -> tuple[VersionSpan, ...]:
        """Count `count` new tokens made by `version`; a new version starts a new span."""
        if count == 0 or version is None:
            return self.spans
        last = self.spans[-1] if self.spans else None
        if last is not None and last.version == version:
            self.spans = (*self.spans[:-1], VersionSpan(version, last.start, last.end + count))
        else:
            start = last.end if last is not None else 0
            self.spans = (*self.spans, VersionSpan(version, start, start + count))
        return self.spans


class EngineLoop:
    """Owns an StepEngine and drives it from one thread.

    Args:
        engine: the engine; nothing else may call it once the loop is started.
        version: the weight version the engine holds at start (None: nothing servable yet).
        on_failure: called from the loop thread with each exception a step raised.
    """

    def __init__(
        self,
        engine: StepEngine,
        version: int | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self._version = version
        self._on_failure = on_failure
        self.failed_steps = 0
        """Steps that raised since the last one that did not."""
        self.last_failure = ""
        """The last step's error, while `failed_steps` > 0."""
        self._cond = threading.Condition()
        self._pending: deque[_Submission] = deque()
        self._active: dict[str, _Submission] = {}
        self._cancelled: set[str] = set()
        self._mode: PauseMode | None = None
        self._epoch = 0  # bumped by every pause request; the loop echoes it when it parks
        self._parked_epoch = -1
        self._parked = False
        self._calls: deque[tuple[Callable[[], object], concurrent.futures.Future[object]]] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="server-engine-loop", daemon=True)

    # --- read by the server ---------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The weight version new tokens are produced with, or None (not servable)."""
        return self._version

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_running(self) -> int:
        return len(self._active)

    # --- requests -------------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, deliver: Deliver) -> None:
        """Queue a request; `deliver` is called from the loop thread with each TokenEvent."""
        with self._cond:
            if self._closed:
                raise ResourceError("the engine loop is closed (the server is shutting down)")
            self._pending.append(_Submission(request_id, prompt_token_ids, params, deliver))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        """Drop a request (its client went away); it gets no further events."""
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify_all()

    # --- pausing --------------------------------------------------------------------------------

    def pause(self, mode: PauseMode) -> int:
        """Pause in `mode` (a later call changes the mode); returns the ticket `wait_parked` takes."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            self._mode = mode
            self._epoch += 1
            self._cond.notify_all()
            return self._epoch

    def wait_parked(self, ticket: int, timeout: float | None = None) -> bool:
        """Wait until the loop parked for pause `ticket` (no step running, none to come): True;
        False if the pause was lifted first, the loop closed, or `timeout` passed."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self._mode is None or (self._parked and self._parked_epoch >= ticket), timeout
            )
            return not self._closed and self._mode is not None and self._parked and self._parked_epoch >= ticket

    def resume(self) -> None:
        with self._cond:
            self._mode = None
            self._cond.notify_all()

    def set_version(self, version: int | None) -> None:
        """The weight version new tokens are produced with from now on (None: not servable)."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def call(self, work: Callable[[], object], timeout: float) -> object:
        """Run `work` on the loop's thread between two steps; its result (or its exception).

        Raises:
            ResourceError: the loop did not get to it within `timeout` seconds, or is closed.
        """
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise ResourceError("the engine loop is closed (the server is shutting down)")
            self._calls.append((work, future))
            self._cond.notify_all()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise ResourceError(f"the engine loop did not take the work within {timeout} s") from exc

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still queued or running end with finish_reason "abort"."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._decide():
                    self._parked = True
                    self._parked_epoch = self._epoch
                    self._cond.notify_all()
                    self._cond.wait()
                self._parked = False
                if self._closed:
                    self._finish_all()
                    return
                version = self._version
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failing step must not kill the server: fail its requests
                self._step_failed(exc)
                continue
            self.failed_steps, self.last_failure = 0, ""
            for output in outputs:
                self._dispatch(output, version)

    def _decide(self) -> bool:
        """Apply queued changes; True when the loop should step (or exit), False to park."""
        if self._closed:
            return True
        self._run_calls()
        touch_engine = self._mode in (None, "wait")
        if self._mode == "abort" or self._version is None:
            self._abort_active("abort")
            touch_engine = False
        if touch_engine:
            self._apply_cancels()
        if touch_engine and self._mode is None and self._version is not None:
            while self._pending:
                self._admit(self._pending.popleft())
        return touch_engine and self._version is not None and self.engine.has_unfinished()

    def _run_calls(self) -> None:
        while self._calls:
            work, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:
                future.set_exception(exc)

    def _admit(self, submission: _Submission) -> None:
        if submission.request_id in self._cancelled:
            self._cancelled.discard(submission.request_id)
            return
        try:
            self.engine.add_request(submission.request_id, submission.prompt_token_ids, submission.params)
        except Exception as exc:
            log.warning("engine refused request %s: %s", submission.request_id, exc)
            submission.deliver(failure(exc, self._version))
            return
        self._active[submission.request_id] = submission

    def _step_failed(self, exc: Exception) -> None:
        log.error("engine step failed: %s", exc, exc_info=exc)
        self.failed_steps += 1
        self.last_failure = str(exc)
        if self._on_failure is not None:
            self._on_failure(exc)
        with self._cond:
            for request_id, submission in list(self._active.items()):
                del self._active[request_id]
                with contextlib.suppress(Exception):  # a failing engine: its requests end here either way
                    self.engine.abort(request_id)
                submission.deliver(failure(exc, self._version))

    def _apply_cancels(self) -> None:
        for request_id in list(self._cancelled):
            if request_id in self._active:
                del self._active[request_id]
                self.engine.abort(request_id)
                self._cancelled.discard(request_id)
        self._cancelled.intersection_update(s.request_id for s in self._pending)

    def _abort_active(self, reason: str) -> None:
        for request_id, submission in list(self._active.items()):
            self.engine.abort(request_id)
            del self._active[request_id]
            submission.deliver(TokenEvent([], None, self._version, True, reason, spans=submission.spans))

    def _finish_all(self) -> None:
        self._abort_active("abort")
        while self._pending:
            self._pending.popleft().deliver(TokenEvent([], None, self._version, True, "abort"))

    def _dispatch(self, output: StepOutput, version: int | None) -> None:
        with self._cond:
            submission = self._active.get(output.request_id)
            if submission is None:
                return
            if output.finished:
                del self._active[output.request_id]
        base_version = None
        if output.adapter_version is not None:  # the version of what the request asked for: its adapter
            base_version, version = version, output.adapter_version
        event = TokenEvent(
            output.new_token_ids,
            output.new_logprobs,
            version,
            output.finished,
            output.finish_reason,
            output.new_top_logprobs,
            spans=submission.record(version, len(output.new_token_ids)),
            base_version=base_version,
        )
        submission.deliver(event)
