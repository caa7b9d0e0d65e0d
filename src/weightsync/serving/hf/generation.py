"""One HTTP request's choices in the engine loop: submitted together, their token events read
from one queue in the order the loop made them, for a whole response or a stream of chunks.

Stop strings are matched here, on the decoded text, so they work the same on every engine: the
text ends before the first stop string, and the choice is cancelled in the loop at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from weightsync.serving.hf.base import SamplingParams
from weightsync.serving.hf.loop import TokenEvent, VersionSpan
from weightsync.serving.hf.server import RolloutServer

__all__ = ["Delta", "Generation", "Output"]

INCOMPLETE = "\ufffd"
"""What a tokenizer decodes the first bytes of a multi-byte character to: held back mid-stream."""


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    """What a choice produced since the last chunk sent for it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    version: int
    offset: int = 0
    """Characters of token text before this delta's first token (OpenAI's `text_offset`)."""


class Output:
    """One choice: its tokens, logprobs and version spans as the loop delivered them."""

    def __init__(self, tokenizer: Any, stop: list[str] | None, version: int) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.spans: tuple[VersionSpan, ...] = ()
        self.version = version
        """The version of the last event (at first: the one served when the request passed the gate)."""
        self.base_version: int | None = None
        """With a LoRA adapter: the base weights' version under its last token."""
        self.finish_reason: str | None = None
        self.finished = False
        self.text_end: int | None = None
        """Where a stop string cut the text, once one was generated."""
        self.error: str | None = None
        self.error_status = 500
        self._sent_tokens = 0
        self._sent_text = 0
        self._sent_offset = 0

    def add(self, event: TokenEvent) -> None:
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs or []
        self.top_logprobs += event.top_logprobs or []
        self.spans = event.spans or self.spans
        if event.version is not None:
            self.version = event.version
        if event.base_version is not None:
            self.base_version = event.base_version
        self.finish_reason = event.finish_reason
        self.finished = event.finished
        if event.error is not None:
            self.error, self.error_status = event.error, event.error_status
        if self.stop and event.token_ids:
            text = self.text()
            found = [at for at in (text.find(stop) for stop in self.stop) if at >= 0]
            if found:
                self.text_end, self.finish_reason, self.finished = min(found), "stop", True

    @property
    def weight_version(self) -> int:
        """The version of the choice's last token (or, with no token, the version it ran under)."""
        return self.spans[-1].version if self.spans else self.version

    def text(self) -> str:
        if self.tokenizer is None:  # a model without a tokenizer: token ids only
            return ""
        return str(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))[: self.text_end]

    def piece(self, token: int) -> str:
        """One token as text (its id as text when there is no tokenizer)."""
        return str(token) if self.tokenizer is None else str(self.tokenizer.decode([token]))

    def delta(self) -> Delta:
        """What is new since the last delta. Mid-stream, text that might still become a stop
        string, or an incomplete character, waits for the next one; the last delta has it all."""
        text = self.text()
        end = len(text)
        if not self.finished:
            while end > self._sent_text and text[end - 1] == INCOMPLETE:
                end -= 1
            held = [k for stop in self.stop for k in range(1, len(stop)) if text[:end].endswith(stop[:k])]
            end = max(self._sent_text, end - max(held, default=0))
        new_text = text[self._sent_text : end]
        self._sent_text = max(self._sent_text, end)
        start, self._sent_tokens = self._sent_tokens, len(self.token_ids)
        offset = self._sent_offset
        if self.logprobs:  # text offsets are reported with logprobs only: decode pieces only then
            self._sent_offset += sum(len(self.piece(t)) for t in self.token_ids[start:])
        return Delta(
            new_text,
            self.token_ids[start:],
            self.logprobs[start:],
            self.top_logprobs[start:],
            self.weight_version,
            offset,
        )

    def whole(self) -> Delta:
        """Everything the choice produced (for a response that is not streamed)."""
        return Delta(self.text(), self.token_ids, self.logprobs, self.top_logprobs, self.weight_version)


class Generation:
    """The choices of one request, submitted to the engine loop; `n` per prompt, in order
    (choice `i * n + k` is sample k of prompt i, with `params(k)`). `version` is the one served
    when the request passed the gate."""

    def __init__(
        self,
        server: RolloutServer,
        request_id: str,
        prompts: list[list[int]],
        n: int,
        params: Callable[[int], SamplingParams],
        stop: list[str] | None,
        version: int,
    ) -> None:
        self.server = server
        self.request_id = request_id
        self.prompts = prompts
        self.outputs = [Output(server.tokenizer, stop, version) for _ in range(len(prompts) * n)]
        self._queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for index in range(len(self.outputs)):

            def deliver(event: TokenEvent, index: int = index) -> None:
                loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))

            server.loop.submit(self._id(index), prompts[index // n], params(index % n), deliver)

    def _id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)

    @property
    def failure(self) -> Output | None:
        return next((output for output in self.outputs if output.error is not None), None)

    async def next(self) -> int:
        """Wait for the next event of a choice still running; apply it; return the choice's index.
        (The engine loop ends every request it holds, on close too: an event always comes.)"""
        while True:
            index, event = await self._queue.get()
            output = self.outputs[index]
            if output.finished:  # tokens already in flight when a stop string cancelled it
                continue
            output.add(event)
            if output.finished and not event.finished:  # a stop string: no more tokens for it
                self.server.loop.cancel(self._id(index))
            return index

    def cancel(self) -> None:
        """Stop generating for every choice still running (the client went away, or one failed)."""
        for index, output in enumerate(self.outputs):
            if not output.finished:
                self.server.loop.cancel(self._id(index))

    def usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens): each prompt once, as vLLM counts it, however many
        choices it has; every choice's tokens."""
        return sum(len(p) for p in self.prompts), sum(len(o.token_ids) for o in self.outputs)

    @property
    def weight_version(self) -> int:
        """The newest version any choice was produced with."""
        return max(output.weight_version for output in self.outputs)

    @property
    def base_version(self) -> int | None:
        """With a LoRA adapter: the newest base weights' version under any choice, else None."""
        return max((o.base_version for o in self.outputs if o.base_version is not None), default=None)
