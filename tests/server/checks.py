"""Behaviour checked the same way on every engine: stop strings, top logprobs, staged syncs."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.helpers import WAIT_S, wait_until
from tests.server.conftest import LiveServer
from weightsync import PlanError, TensorMeta, WeightSender

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
    from transformers import AutoTokenizer

    tokenizer = (
        server.server.tokenizer if server.server is not None else AutoTokenizer.from_pretrained(server.config.model)
    )
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


class _Gated:
    """A source that yields its first tensor, then waits for `gate` (a sync held open midway),
    or, with `broken`, yields a tensor that contradicts its metadata instead of the rest."""

    def __init__(self, tensors: dict[str, torch.Tensor], gate: threading.Event | None = None, broken: bool = False):
        self.items, self.gate, self.broken = list(tensors.items()), gate, broken

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in self.items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield self.items[0]
        if self.gate is not None:
            assert self.gate.wait(WAIT_S * 3)
        if self.broken:
            name, tensor = self.items[1]
            yield name, tensor.flatten()[:1]
        yield from self.items[1:]


WEIGHT_INFO = {
    "version": (int, type(None)),
    "last_committed": (int, type(None)),
    "state": str,
    "last_error": str,
    "last_sync": dict,
    "content_digest": str,
    "transport": str,
    "addresses": list,
    "sync_mode": str,
    "paused_by": dict,
    "weight_bytes": int,
    "workers": int,
    "engine": str,
    "model": str,
    "adapters": list,
}
"""GET /weight_info: one schema for every engine (serving/control.py, `weight_info`)."""


def check_weight_info(server: LiveServer) -> None:
    """/weight_info has exactly the fields of `WEIGHT_INFO`, of their types, whatever the engine."""
    info = server.client.weight_info()
    assert set(info) == set(WEIGHT_INFO), sorted(set(info) ^ set(WEIGHT_INFO))
    for field, kind in WEIGHT_INFO.items():
        assert isinstance(info[field], kind), (field, info[field])
    assert len(info["addresses"]) == info["workers"] and info["weight_bytes"] > 0, info
    assert set(info["last_sync"]) >= {"version", "bytes", "bucket_bytes", "seconds", "ok", "times"}, info


def check_staged(server: LiveServer, weights: dict[str, torch.Tensor]) -> None:
    """A staged server serves its version during the transfer of the next one, switches at the
    commit, and keeps serving it, ready and bit-for-bit the same, after a sync that fails; its
    /weight_info has the one schema."""
    prompt = PROMPT
    with WeightSender([server.address], timeout=WAIT_S * 3, bucket_bytes=1 << 16) as sender:
        assert sender.push(weights, 1).ok
        check_weight_info(server)
        first = server.client.completions(prompt, max_tokens=8, temperature=0)["choices"][0]["token_ids"]

        moved = {name: tensor * 2 for name, tensor in weights.items()}
        gate, reports = threading.Event(), []
        pushing = threading.Thread(target=lambda: reports.append(sender.push(_Gated(moved, gate), 2)))
        pushing.start()
        try:
            assert wait_until(lambda: server.client.weight_info()["state"] == "syncing")
            during = server.client.completions(prompt, max_tokens=8, temperature=0)  # not held by the sync
            assert during["weight_version"] == 1 and during["choices"][0]["token_ids"] == first
        finally:
            gate.set()
            pushing.join(WAIT_S * 3)
        assert reports and reports[0].ok, reports
        second = server.client.completions(prompt, max_tokens=8, temperature=0)
        assert second["weight_version"] == 2

        with pytest.raises(PlanError):
            sender.push(_Gated(weights, broken=True), 3)
        assert wait_until(lambda: server.client.weight_info()["state"] != "syncing")
        info = server.client.weight_info()
        assert (info["version"], info["state"]) == (2, "ready"), info
        after = server.client.completions(prompt, max_tokens=8, temperature=0)
        assert after["weight_version"] == 2
        assert after["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
