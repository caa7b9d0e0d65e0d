"""What a rollout server checks before it serves anything: that its engine can run the model (a
one-token warm-up generation), and whether the model directory has a tokenizer.

A server that started but cannot generate would answer every request with nothing: in an RL loop,
silent empty rollouts. The warm-up runs on the weights the engine starts with (dummy ones, before
any sync), through the same `add_request`/`step` path every request takes, and a failure refuses
to start with the engine's own error.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from weightsync.errors import ConfigError
from weightsync.serving.hf.base import Engine, SamplingParams

__all__ = ["NO_CHAT_TEMPLATE", "TOKENIZER_FILES", "WARM_UP_MAX_STEPS", "load_tokenizer", "warm_up"]

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")
"""Files one of which a model directory with a tokenizer holds (transformers builds an empty
tokenizer, which turns every text into no tokens, from a directory that has none)."""

WARM_UP_MAX_STEPS = 64
"""Steps the warm-up may take to produce its one token (an engine may schedule before it runs)."""

WARM_UP_ID = "weightsync-warm-up"


NO_CHAT_TEMPLATE = (
    "%s: the tokenizer has no chat template: /v1/chat/completions answers 400 (give --chat-template FILE)"
)
"""The one start-up line of a server whose model cannot chat (%s: the model directory)."""


def load_tokenizer(model_dir: str | Path, chat_template: str | Path | None = None) -> tuple[Any, str]:
    """The model's tokenizer, with the Jinja template in the file `chat_template` as its chat
    template when given; or (None, why there is none): then text prompts are refused."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None, f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        return None, f"the tokenizer in {model_dir} does not load: {exc}"
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    return tokenizer, ""


def warm_up(engine: Engine, model: str) -> None:
    """Generate one token from a one-token prompt, as a request would, before serving.

    Raises:
        ConfigError: the engine cannot run this model (its step raised, or it produced nothing).
    """
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        engine.add_request(WARM_UP_ID, [0], params)
        tokens: list[int] = []
        for _ in range(WARM_UP_MAX_STEPS):
            for output in engine.step():
                tokens += output.new_token_ids
            if not engine.has_unfinished():
                break
    except Exception as exc:
        with contextlib.suppress(Exception):
            engine.abort(WARM_UP_ID)
        raise ConfigError(
            f"the {engine.name} engine cannot run {model}: a one-token warm-up generation failed: {exc}"
        ) from exc
    if engine.has_unfinished() or not tokens:
        engine.abort(WARM_UP_ID)
        raise ConfigError(
            f"the {engine.name} engine cannot run {model}: a one-token warm-up generation produced no token "
            f"in {WARM_UP_MAX_STEPS} steps"
        )
    log.info("warm-up: the %s engine generated a token", engine.name)
