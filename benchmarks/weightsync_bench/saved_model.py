"""A Qwen2-shaped model saved to disk, as an engine loads it, and its place in the page cache.

The scripts in benchmarks/ that start an engine (bench_server, bench_lora, bench_reload,
bench_vllm) build their model here: random real weights, saved with a one-character-per-token
tokenizer, so that nothing is downloaded.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

__all__ = ["PROMPT", "VOCAB", "VOCAB_SIZE", "build_model", "evict_from_page_cache", "read_through"]

GIB = 1 << 30
PROMPT = [5, 6, 7, 8]
"""A short prompt of token ids the model's tokenizer has."""
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
VOCAB = {token: index for index, token in enumerate(["<pad>", "<unk>", "<eos>", *CHARS])}
"""A one-character-per-token vocabulary (letters, digits, punctuation, space, newline): no download."""
VOCAB_SIZE = 128
"""The model's vocabulary size: the tokenizer's ids, padded (ids it never produces are fine)."""


def build_model(path: Path, size_gb: float, dtype: str = "bfloat16", vocab_size: int = VOCAB_SIZE) -> int:
    """A Qwen2-shaped model of about `size_gb` GiB in `dtype` (a torch dtype's name) saved at
    `path`, with `vocab_size` embedding rows (the tokenizer's ids and never-produced ones);
    returns its parameter bytes."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from weightsync.demo.task import save_char_tokenizer

    hidden, intermediate = 1536, 4096
    element_bytes = getattr(torch, dtype).itemsize
    per_layer = element_bytes * (2 * hidden * hidden + 2 * hidden * 256 + 3 * hidden * intermediate)
    layers = max(1, round((size_gb * GIB - element_bytes * 2 * vocab_size * hidden) / per_layer))
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    save_char_tokenizer(path, VOCAB)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def evict_from_page_cache(model: Path) -> None:
    """Drop the checkpoint's pages from the page cache, so the next load reads the disk."""
    for path in model.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(model: Path) -> None:
    """Read the checkpoint once, so that it is in the page cache whatever wrote it."""
    for path in model.glob("*.safetensors"):
        with path.open("rb") as file:
            while file.read(64 << 20):
                pass
