"""The model directory's tokenizer, as every rollout server loads it at start-up: whether there is
one, and whether it can chat."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["NO_CHAT_TEMPLATE", "TOKENIZER_FILES", "load_tokenizer"]

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")
"""Files one of which a model directory with a tokenizer holds (transformers builds an empty
tokenizer, which turns every text into no tokens, from a directory that has none)."""


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
