"""The task: after a digit d and "=", write the next digit, (d + 1) mod 10, four times.

Small enough for a tiny model to learn from scratch on a CPU in minutes, and checked by a
function, not a learned reward: each of the four positions scores a quarter. A random policy
over the 14-token vocabulary scores about 0.07.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SPECIAL = ["<pad>", "<unk>", "<eos>"]
CHARS = list("0123456789=")
VOCAB = {token: index for index, token in enumerate(SPECIAL + CHARS)}
EOS_ID = VOCAB["<eos>"]
ANSWER_LENGTH = 4


def prompt_text(digit: int) -> str:
    return f"{digit}="


def answer_text(digit: int) -> str:
    return str((digit + 1) % 10) * ANSWER_LENGTH


def encode(text: str) -> list[int]:
    return [VOCAB[char] for char in text]


def decode(token_ids: list[int]) -> str:
    return "".join(CHARS[t - len(SPECIAL)] if t >= len(SPECIAL) else "" for t in token_ids)


def reward(digit: int, completion_ids: list[int]) -> float:
    """The fraction of the four answer positions the completion gets right."""
    text = decode(completion_ids[:ANSWER_LENGTH])
    return sum(a == b for a, b in zip(text, answer_text(digit), strict=False)) / ANSWER_LENGTH


def sample_digits(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10) for _ in range(count)]


CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ message['content'] }}{% endif %}{% endfor %}"
)
"""The policy's chat template: a chat is its user turns' text, which for this task is a prompt
("3="): /v1/chat/completions answers what /v1/completions would. The tokenizer has no other
characters to render roles with."""


def save_tokenizer(path: Path) -> None:
    """The task's character tokenizer, with its chat template, saved where a rollout server loads
    it from."""
    save_char_tokenizer(path, VOCAB, CHAT_TEMPLATE)


def save_char_tokenizer(path: Path, vocab: dict[str, int], chat_template: str | None = None) -> None:
    """A one-character-per-token WordLevel tokenizer over `vocab` (which holds <pad>, <unk> and
    <eos>), saved as tokenizer.json and its config: no download, loadable by AutoTokenizer.
    With `chat_template` (Jinja), the tokenizer renders chats with it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)


def build_policy(path: Path, seed: int = 0, served_dtype: str = "float32") -> PreTrainedModel:
    """A tiny Qwen2-shaped causal LM from a config (no download), random weights from `seed`,
    trained in float32 and served in `served_dtype` (what the pushes cast to).

    `path` gets its config and tokenizer, what a rollout server starting on dummy weights needs;
    no weights: `save_policy` writes the trained ones at the end of a run. head_dim 32 keeps it
    loadable by vLLM's CPU backend too (it has no kernel for 16).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        eos_token_id=EOS_ID,
        pad_token_id=VOCAB["<pad>"],
        bos_token_id=None,
        dtype=served_dtype,  # named in config.json: the servers build this dtype, the one the trainer pushes
        architectures=["Qwen2ForCausalLM"],  # how an engine (SGLang, vLLM) finds its model class
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.dtype = served_dtype  # from_config wrote the dtype it built in
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").unlink(missing_ok=True)  # an earlier run's weights are not this policy's
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    save_tokenizer(path)
    return model


def save_policy(model: PreTrainedModel, path: Path) -> None:
    """The policy's weights (safetensors), config and tokenizer at `path`: a checkpoint that
    `weightsync serve`, `push` and `digest` take as they are."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: a progress bar is only noise
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    save_tokenizer(path)


def pretrain(model: PreTrainedModel, steps: int, seed: int = 0, batch: int = 64, lr: float = 3e-3) -> None:
    """Pretrain `model` on a neighbouring skill, not on the task (supervised, `steps` batches).

    Half the examples are sums: "ab=" answered by (a + b) mod 10, four times. The other half
    are the task's own prompts, "d=", answered by a random digit four times: the model learns
    to add, the answer's form, and that any first digit is as likely as another after "d=".
    Its reward on the task is chance (about 0.1), and every right answer is sampled about one
    time in ten, which is what an adapter learning "d=" means "d+1" from its own samples needs.
    Leaving that first digit untaught instead left it to whatever the sums generalised to:
    on some digits the right answer had odds below 1 in 1000, never sampled, never learned.
    """
    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    width = 3 + ANSWER_LENGTH + 1  # "ab=", the answer, EOS
    for _ in range(steps):
        inputs, targets = [], []
        for _ in range(batch):
            a, b = rng.randrange(10), rng.randrange(10)
            prompt = f"{a}{b}=" if rng.random() < 0.5 else prompt_text(a)  # after "d=": a random digit
            ids = encode(prompt + str((a + b) % 10) * ANSWER_LENGTH) + [EOS_ID]
            # labels[i] is what position i predicts; -100 is cross_entropy's "ignore"
            labels = [-100] * (len(prompt) - 1) + ids[len(prompt) :]
            inputs.append(ids + [VOCAB["<pad>"]] * (width - len(ids)))
            targets.append(labels + [-100] * (width - 1 - len(labels)))
        logits = model(input_ids=torch.tensor(inputs)).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(targets).reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
