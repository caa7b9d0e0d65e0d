"""Request and response bodies of the HTTP API: OpenAI completions and chat completions (plain
and streamed), plus the weight versions that produced each choice.

Responses are dumped without their None fields, except a streamed choice's `finish_reason`,
which OpenAI always sends (null until the choice ends).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ChatChoice",
    "ChatChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprob",
    "ChatLogprobs",
    "ChatMessage",
    "ChatStreamChoice",
    "ChatTopLogprob",
    "Choice",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamChoice",
    "Envelope",
    "GenerationRequest",
    "Logprobs",
    "OutputMessage",
    "StreamOptions",
    "TextPart",
    "Usage",
    "WeightVersionSpan",
]


# --- requests -------------------------------------------------------------------------------------

DEFAULT_MAX_TOKENS = 16
"""Tokens generated when a request names no max_tokens (OpenAI's completions default; chat too)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """Send one last chunk, with no choices, that carries the request's `usage`."""


class GenerationRequest(BaseModel):
    """What completions and chat requests share. Fields OpenAI defines but this server ignores
    are accepted and dropped."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str] | None:
        """OpenAI's rule: up to 4 stop sequences; an empty one would stop before any text."""
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or not all(stops)):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops or None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> list[str] | None:
        """`stop` as a list (the validator made a lone string one)."""
        return [self.stop] if isinstance(self.stop, str) else self.stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(BaseModel):
    """One part of a message's content; only text parts are served (no images or audio)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined with newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions: the messages are rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; wins when both are given. Neither: 16, as completions."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# --- responses ------------------------------------------------------------------------------------


class WeightVersionSpan(BaseModel):
    """Output tokens `[start, end)` of a choice were produced by weight `version` (vLLM 0.32's
    `WeightVersionSpan`, whose version is a label string; weightsync versions are ints)."""

    version: int
    start: int
    end: int


class Logprobs(BaseModel):
    """A completion choice's logprobs (OpenAI's legacy completions format)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    """With `logprobs: N` >= 1, per token: the N most likely tokens and the chosen one."""
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs (OpenAI's chat format): one entry per generated token."""

    content: list[ChatLogprob]


class ChoiceVersions(BaseModel):
    """The weight versions a response's choice carries (a base of `Choice` and `ChatChoice`)."""

    weight_version: int
    """The version that produced the choice's last token (the only one, unless a keep-mode sync
    landed while it was generated)."""
    weight_versions: list[WeightVersionSpan]
    """Every version that produced the choice's tokens, with the output-token indexes each made;
    one span normally, none for a choice that ended before its first token."""


class Choice(ChoiceVersions):
    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: str | None


class OutputMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ChoiceVersions):
    index: int
    message: OutputMessage
    token_ids: list[int]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class Usage(BaseModel):
    """Tokens of the request: each prompt counted once however many choices it has (`n`), as
    vLLM counts them; completion tokens summed over every choice."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Envelope(BaseModel):
    """What every response and every chunk carries besides its choices."""

    id: str
    created: int
    model: str
    weight_version: int
    """The newest version any choice was produced with (in a chunk: the version of its tokens)."""
    base_version: int | None = None
    """For a request naming a LoRA adapter, whose version `weight_version` is: the version of
    the base weights under it; null for a request on the base model."""


class CompletionResponse(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[Choice]
    usage: Usage


class ChatCompletionResponse(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


# --- streamed responses (server-sent events) ------------------------------------------------------


class StreamChoiceVersions(BaseModel):
    """The weight versions a streamed chunk's choice carries."""

    weight_version: int
    """The version that produced this chunk's tokens."""
    weight_versions: list[WeightVersionSpan] | None = None
    """On a choice's last chunk only (the one with its finish_reason): the whole choice's spans."""


class CompletionStreamChoice(StreamChoiceVersions):
    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
    """On the last chunk (no choices) of a stream with stream_options.include_usage only."""


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(StreamChoiceVersions):
    index: int
    delta: ChatDelta
    token_ids: list[int]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
