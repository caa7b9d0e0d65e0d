"""Prompts to token ids: completions' text or token ids, and chat messages through the
tokenizer's chat template. Called on a worker thread: a long text takes a while, and /health
must answer meanwhile.

A chat is rendered to text with the template (`add_generation_prompt=True`), then tokenised
without special tokens, as vLLM does: the template writes every special token it wants.
"""

from __future__ import annotations

from typing import Any

from weightsync.errors import RequestError
from weightsync.serving.hf.schemas import ChatMessage

__all__ = ["chat_prompt", "has_text", "no_chat_reason", "tokenize"]


def has_text(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def tokenize(tokenizer: Any, prompt: Any) -> list[list[int]]:
    """Prompt text, token ids, or a list of either -> one list of token ids per prompt.

    Raises:
        RequestError: a prompt is empty, has no tokens, or a negative token id.
    """
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt is empty")
    ids = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for one in ids:
        if not one:
            raise RequestError("a prompt has no tokens")
        if min(one) < 0:
            raise RequestError(f"token id {min(one)} is negative")
    return ids


def no_chat_reason(tokenizer: Any, no_tokenizer: str) -> str | None:
    """Why this server cannot serve chat (no tokenizer, or one without a chat template), or None."""
    if tokenizer is None:
        return f"chat completions need the model's tokenizer and its chat template: {no_tokenizer}"
    if not getattr(tokenizer, "chat_template", None):
        return (
            "the model's tokenizer has no chat template (tokenizer_config.json or chat_template.jinja): "
            "use /v1/completions with a prompt rendered by the client"
        )
    return None


def chat_prompt(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """The token ids of `messages` rendered by the chat template, ready for the assistant's turn.

    Raises:
        RequestError: the template refuses the messages (a role it does not know, say), or they
            render to no tokens.
    """
    conversation = [{"role": m.role, "content": m.text} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2's TemplateError (raise_exception in a template), ValueError, TypeError
        if not isinstance(exc, (ValueError, TypeError, KeyError)) and not _is_template_error(exc):
            raise
        raise RequestError(f"the chat template refused the messages: {exc}") from exc
    if not isinstance(text, str):  # a template returns text with tokenize=False; anything else is a bug here
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise RequestError("the messages render to no tokens")
    return ids


def _is_template_error(exc: BaseException) -> bool:
    """jinja2.TemplateError or a subclass (jinja2 comes with transformers; not imported here)."""
    return any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__)
