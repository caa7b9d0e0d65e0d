"""Request and response bodies of the HTTP API (OpenAI completions, plus weight versions)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
    stop_token_ids: list[int] | None = None
    stream: bool = False


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
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
