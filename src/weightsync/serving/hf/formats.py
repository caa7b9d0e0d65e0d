"""How choices are written in each OpenAI API: completions (`text`, legacy logprobs) and chat
(`message` / `delta`, chat logprobs), whole or as stream chunks. Every choice and chunk carries
its weight version; a choice's last chunk carries its version spans."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from weightsync.serving.hf.generation import Delta, Generation, Output
from weightsync.serving.hf.schemas import (
    ChatChoice,
    ChatChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTopLogprob,
    Choice,
    CompletionChunk,
    CompletionResponse,
    CompletionStreamChoice,
    Envelope,
    Logprobs,
    OutputMessage,
    Usage,
    WeightVersionSpan,
)

__all__ = ["ChatFormat", "CompletionFormat", "Format", "dump", "usage"]


def spans(output: Output) -> list[WeightVersionSpan]:
    return [WeightVersionSpan(version=s.version, start=s.start, end=s.end) for s in output.spans]


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON without None fields, but with every streamed choice's `finish_reason` (null until it
    ends), as OpenAI sends it."""
    body = model.model_dump(exclude_none=True)
    if isinstance(model, (CompletionChunk, ChatChunk)):
        for choice in body["choices"]:
            choice.setdefault("finish_reason", None)
    return body


class Format(ABC):
    """One API's way of writing choices. `logprobs`: None for none, else the top alternatives
    asked for per token (0: the chosen token's logprob only)."""

    response_type: Callable[..., Envelope]
    chunk_type: Callable[..., Envelope]

    def __init__(self, logprobs: int | None) -> None:
        self.logprobs = logprobs

    @abstractmethod
    def choice(self, index: int, output: Output, whole: Delta) -> BaseModel:
        """One choice of a whole response."""

    @abstractmethod
    def stream_choice(self, index: int, output: Output, delta: Delta, first: bool) -> BaseModel:
        """One choice's part of a chunk: what `delta` brings; `first`: the choice's first chunk."""

    def response(self, request_id: str, created: int, model: str, generation: Generation) -> Envelope:
        """The whole response (not streamed)."""
        outputs = generation.outputs
        return self.response_type(
            id=request_id,
            created=created,
            model=model,
            choices=[self.choice(index, output, output.whole()) for index, output in enumerate(outputs)],
            usage=usage(*generation.usage()),
            weight_version=generation.weight_version,
            base_version=generation.base_version,
        )

    def chunk(
        self, request_id: str, created: int, model: str, index: int, output: Output, delta: Delta, first: bool
    ) -> Envelope:
        """One chunk of one choice; the choice's last when `output.finished`."""
        choice = self.stream_choice(index, output, delta, first)
        return self.chunk_type(
            id=request_id,
            created=created,
            model=model,
            choices=[choice],
            weight_version=delta.version,
            base_version=output.base_version,
        )

    def usage_chunk(self, request_id: str, created: int, model: str, generation: Generation) -> Envelope:
        """The last chunk of a stream that asked for usage: no choices."""
        tokens, version = generation.usage(), generation.weight_version
        return self.chunk_type(
            id=request_id, created=created, model=model, choices=[], usage=usage(*tokens), weight_version=version
        )


def ending(output: Output) -> dict[str, Any]:
    """A stream choice's finish_reason and, on its last chunk, its version spans."""
    if not output.finished:
        return {"finish_reason": None}
    return {"finish_reason": output.finish_reason, "weight_versions": spans(output)}


class CompletionFormat(Format):
    response_type = CompletionResponse
    chunk_type = CompletionChunk

    def _logprobs(self, output: Output, delta: Delta) -> Logprobs | None:
        if self.logprobs is None:
            return None
        pieces = [output.piece(t) for t in delta.token_ids]
        offsets = list(itertools.accumulate((len(p) for p in pieces), initial=delta.offset))[:-1]
        top = [{output.piece(t): lp for t, lp in one.items()} for one in delta.top_logprobs]
        return Logprobs(tokens=pieces, token_logprobs=delta.logprobs, top_logprobs=top or None, text_offset=offsets)

    def choice(self, index: int, output: Output, whole: Delta) -> Choice:
        return Choice(
            index=index,
            text=whole.text,
            token_ids=whole.token_ids,
            logprobs=self._logprobs(output, whole),
            finish_reason=output.finish_reason,
            weight_version=output.weight_version,
            weight_versions=spans(output),
        )

    def stream_choice(self, index: int, output: Output, delta: Delta, first: bool) -> CompletionStreamChoice:
        return CompletionStreamChoice(
            index=index,
            text=delta.text,
            token_ids=delta.token_ids,
            logprobs=self._logprobs(output, delta),
            weight_version=delta.version,
            **ending(output),
        )


class ChatFormat(Format):
    response_type = ChatCompletionResponse
    chunk_type = ChatChunk

    def _logprobs(self, output: Output, delta: Delta) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for position, (token, logprob) in enumerate(zip(delta.token_ids, delta.logprobs, strict=False)):
            alternatives = delta.top_logprobs[position] if position < len(delta.top_logprobs) else {}
            ranked = sorted(alternatives.items(), key=lambda item: -item[1])[: self.logprobs]
            content.append(
                ChatLogprob(
                    **_entry(output.piece(token), logprob),
                    top_logprobs=[ChatTopLogprob(**_entry(output.piece(t), lp)) for t, lp in ranked],
                )
            )
        return ChatLogprobs(content=content)

    def choice(self, index: int, output: Output, whole: Delta) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=OutputMessage(content=whole.text),
            token_ids=whole.token_ids,
            logprobs=self._logprobs(output, whole),
            finish_reason=output.finish_reason,
            weight_version=output.weight_version,
            weight_versions=spans(output),
        )

    def stream_choice(self, index: int, output: Output, delta: Delta, first: bool) -> ChatStreamChoice:
        return ChatStreamChoice(
            index=index,
            delta=ChatDelta(role="assistant" if first else None, content=delta.text),
            token_ids=delta.token_ids,
            logprobs=self._logprobs(output, delta),
            weight_version=delta.version,
            **ending(output),
        )


def _entry(piece: str, logprob: float) -> dict[str, Any]:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "replace"))}
