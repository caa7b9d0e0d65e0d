"""Request and response bodies of the HTTP API (OpenAI completions, plus weight versions)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "Choice",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorBody",
    "ErrorResponse",
    "Logprobs",
    "Usage",
]


class CompletionRequest(BaseModel):
    """POST /v1/completions. Fields OpenAI defines but this server ignores are accepted and dropped."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str] | None:
        """OpenAI's rule: up to 4 stop sequences; an empty one would stop before any text."""
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or not all(stops)):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops or None


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    """With `logprobs: N` >= 1, per token: the N most likely tokens and the chosen one."""
    text_offset: list[int]


class Choice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: str | None
    weight_version: int | None
    """The version that produced this choice's last token (the one it was produced with, unless
    a keep-mode sync happened mid-request: then `weight_versions` lists every version, in order)."""
    weight_versions: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    weight_version: int | None
    weight_versions: list[int] | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
