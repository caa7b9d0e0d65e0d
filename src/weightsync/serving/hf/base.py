"""The engine contract: one model that the rollout server's loop steps, and that receives weights.

An engine works on token ids only (the server owns the tokenizer) and is driven by exactly one
thread, the server's engine loop, which never calls it concurrently. Weights land through
`weight_sink()`, and only while the loop is paused, so no step ever runs on half-updated weights.

    server loop:  add_request -> step -> step -> ... (outputs per step) ; abort
    weight sync:  loop paused -> sink.begin -> destination/load per bucket -> sink.commit -> resume
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from weightsync.errors import RequestError
from weightsync.sink import WeightSink

if TYPE_CHECKING:
    from weightsync.serving.hf.lora import LoraServing

__all__ = ["StepEngine", "SamplingParams", "StepOutput", "check_request"]


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one completion.

    Attributes:
        max_tokens: tokens to generate at most.
        temperature: 0 is greedy.
        seed: per-request seed for sampling (ignored when greedy).
        logprobs: return the chosen token's logprob (and this many top alternatives) when not None.
        stop_token_ids: token ids that end the completion (the model's EOS is added by the engine).
        adapter: the LoRA adapter to generate with, by name (its newest version when the request
            is admitted, for the whole request), or None for the base weights alone.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    adapter: str | None = None


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one step produced for one request: only the new tokens since the last step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" when finished by the engine
    new_top_logprobs: list[dict[int, float]] | None = None
    """Per new token, when `logprobs` >= 1: token id -> logprob of the `logprobs` most likely
    tokens at that position, plus the chosen one."""
    adapter_version: int | None = None
    """The version of the adapter the request runs with (`SamplingParams.adapter`), else None."""


class StepEngine(ABC):
    """One model behind weightsync's own rollout server (`serving/hf/engine.py`; vLLM runs its own server)."""

    name: str = ""

    @classmethod  # noqa: B027 (optional hook: an engine that imports nothing late need not override)
    def preload(cls, model_dir: str) -> None:
        """Import what building this engine for `model_dir` will import, without building it.

        `weightsync serve` calls it before its port listens and builds the engine on a thread
        afterwards: an import holds the interpreter for long stretches, and /health must answer
        meanwhile.
        """

    @abstractmethod
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start generating for a request; tokens come out of later `step()` calls."""

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """Advance every unfinished request (by at least one token where possible)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request; it produces no further output."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any added request has not finished or been aborted."""

    @abstractmethod
    def weight_sink(self) -> WeightSink:
        """The sink a WeightReceiver lands syncs into (Hugging Face checkpoint names and layouts)."""

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of model weights the engine holds (to show the server holds no second copy)."""

    @property
    def lora(self) -> LoraServing | None:
        """The engine's LoRA adapters (None: it serves none). Only the engine loop's thread
        installs one (`EngineLoop.call`)."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook: engines without resources need not override)
        """Release the model and its caches."""


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int, known: bool
) -> None:
    """Refuse (RequestError, an HTTP 400) a request no engine should start: a duplicate id, an
    empty prompt, token ids outside the vocabulary, or a prompt plus max_tokens longer than the
    model's context, which would otherwise hold the engine and grow its KV cache without end."""
    if known:
        raise RequestError("a request with this id already exists")
    if not prompt_token_ids:
        raise RequestError("a prompt needs at least one token")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise RequestError(f"prompt token ids must lie in [0, {vocab_size})")
    if len(prompt_token_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceed "
            f"the engine's max_model_len {max_model_len}"
        )
