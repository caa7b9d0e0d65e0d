"""Tiny models and a character tokenizer, built locally (no downloads), shared by the server and
engine tests. Shapes suit the vLLM CPU engine too (head_dim >= 32)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
VOCAB = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARS)}
VOCAB_SIZE = 128  # >= len(VOCAB); the extra ids are never produced by the tokenizer
EOS_ID = VOCAB["<eos>"]

MODEL_KINDS = ("qwen2", "llama")
"""The dense kinds every engine test runs; "qwen3_moe" is built on request (the vLLM backend's tests)."""


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""A chat template in the tokenizer's own characters: "role: content" lines, then "assistant: "."""


def save_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """The tests' character tokenizer (letters, digits, punctuation) saved at `path`, with a chat
    template unless `chat_template` is None."""
    from weightsync.demo.task import save_char_tokenizer

    save_char_tokenizer(path, VOCAB, chat_template)


def model_config(kind: str):  # type: ignore[no-untyped-def]
    """Qwen2: tied embeddings, GQA, fp32. Llama: untied lm_head, bf16. Qwen3-MoE: 4 experts,
    top-2 routing, 4 heads over 2 KV heads (both divide by a tensor parallel size of 2), fp32."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS_ID,
        pad_token_id=VOCAB["<pad>"],
        bos_token_id=None,
        initializer_range=0.2,
    )
    if kind == "qwen2":
        return Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True, **common)
    if kind == "llama":
        return LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common)
    if kind == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
        common.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
        return Qwen3MoeConfig(**moe, **common)
    raise ValueError(kind)


def save_model(kind: str, path: Path, seed: int = 0) -> None:
    """A randomly initialised tiny model of `kind`, saved with safetensors, plus the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(kind))
    if kind == "llama":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    save_tokenizer(path)
