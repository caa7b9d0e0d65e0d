"""Completion options checked the same way on every engine: stop strings and top logprobs."""

from __future__ import annotations

import math

import torch

from tests.server.conftest import LiveServer

PROMPT = [5, 6, 7, 8]


def check_stop_strings(server: LiveServer) -> None:
    """The text ends just before the first stop string generated, finish_reason "stop"; a stop
    string never generated changes nothing. (Seeded sampling: a random tiny model's greedy
    output is mostly ids that decode to no text.)"""
    sampling = {"max_tokens": 32, "temperature": 1.0, "seed": 7}
    full = server.client.completions(PROMPT, **sampling)["choices"][0]
    text = full["text"]
    assert len(text) >= 6, f"the model generated too little text to cut: {text!r}"
    stop = text[3:5]
    cut = text.find(stop)
    body = server.client.completions(PROMPT, **sampling, stop=[stop, "\x00never"])
    choice = body["choices"][0]
    assert choice["text"] == text[:cut]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == full["token_ids"][: len(choice["token_ids"])]
    assert len(choice["token_ids"]) < len(full["token_ids"])
    assert body["weight_version"] == choice["weight_version"] is not None
    unchanged = server.client.completions(PROMPT, **sampling, stop="\x00never")["choices"][0]
    assert (unchanged["text"], unchanged["finish_reason"]) == (text, full["finish_reason"])


def check_top_logprobs(server: LiveServer, reference: torch.nn.Module, k: int = 3) -> None:
    """`logprobs: k` gives, per token, the k most likely tokens with the logprobs the same
    weights give in transformers, and the chosen token's logprob among them."""
    tokenizer = server.server.tokenizer
    choice = server.client.completions(PROMPT, max_tokens=6, temperature=0, logprobs=k)["choices"][0]
    tokens, logprobs = choice["token_ids"], choice["logprobs"]
    with torch.inference_mode():
        logits = reference(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    assert len(logprobs["top_logprobs"]) == len(tokens)
    for position, (token, top) in enumerate(zip(tokens, logprobs["top_logprobs"], strict=True)):
        values, ids = expected[position].topk(k)
        want = {tokenizer.decode([i]): v for i, v in zip(ids.tolist(), values.tolist(), strict=True)}
        assert set(want) <= set(top), (position, want, top)
        for piece, value in want.items():
            assert math.isclose(top[piece], value, abs_tol=2e-3), (position, piece, top[piece], value)
        chosen = tokenizer.decode([token])
        assert math.isclose(top[chosen], logprobs["token_logprobs"][position], abs_tol=1e-6)
