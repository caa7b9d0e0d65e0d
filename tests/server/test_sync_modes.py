"""Requests in flight while a sync lands: each pause mode, and never a silent mix of versions."""

from __future__ import annotations

import re
import threading

import pytest
from safetensors.torch import load_file

from tests.helpers import ENGINES, WAIT_S, wait_until
from tests.server.conftest import live_server
from weightsync import WeightSender

MAX_TOKENS = 100
"""Long enough that the requests started before a sync are still generating when it pauses them
(with 40, a keep-mode request was once seen with one version span: it may have ended before the pause)."""


def running(server) -> int:  # type: ignore[no-untyped-def]
    """Requests generating now: the hf engine's loop, or vLLM's own gauge."""
    if server.server is not None:
        return int(server.server.loop.num_running)
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", server.client.metrics(), re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def run_concurrently(server, prompts):  # type: ignore[no-untyped-def]
    """Start one greedy request per prompt in threads; returns (threads, results list)."""
    results: list[dict] = [{} for _ in prompts]

    def one(index: int) -> None:
        results[index] = server.client.completions(prompts[index], max_tokens=MAX_TOKENS, temperature=0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    return threads, results


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_sync_during_generation(tiny_models, mode, engine) -> None:
    model_dir = tiny_models["qwen2"]
    v1 = load_file(model_dir / "model.safetensors")
    v2 = {name: tensor * 1.5 for name, tensor in v1.items()}
    with (
        live_server(model_dir, sync_mode=mode, engine=engine) as server,
        WeightSender([server.address], timeout=WAIT_S) as sender,
    ):
        assert sender.push(v1, 1).ok
        body = server.client.completions([[i, i + 1] for i in range(3, 13)], max_tokens=MAX_TOKENS, temperature=0)
        # prompts that run to max_tokens on version 1 (no early EOS), so they are in flight at the sync
        long = [(i, c) for i, c in zip(range(3, 13), body["choices"], strict=True) if c["finish_reason"] == "length"]
        prompts = [[i, i + 1] for i, _ in long[:3]]
        alone = [{"choices": [c]} for _, c in long[:3]]
        assert len(prompts) == 3
        threads, results = run_concurrently(server, prompts)
        assert wait_until(lambda: running(server) == len(prompts))
        assert sender.push(v2, 2).ok
        after = server.client.completions(prompts[0], max_tokens=4, temperature=0)
        for thread in threads:
            thread.join(WAIT_S * 3)
        assert after["weight_version"] == 2
        for result, reference in zip(results, alone, strict=True):
            choice = result["choices"][0]
            if mode == "wait":  # drained on version 1 before the sync landed
                assert (choice["weight_version"], choice["finish_reason"]) == (1, "length")
                assert choice["token_ids"] == reference["choices"][0]["token_ids"]
            elif mode == "abort":  # cut short, and only version 1 tokens
                assert (choice["weight_version"], choice["finish_reason"]) == (1, "abort")
                assert len(choice["token_ids"]) < MAX_TOKENS
                assert choice["token_ids"] == reference["choices"][0]["token_ids"][: len(choice["token_ids"])]
            else:  # frozen, then continued on version 2: both versions reported, where each began
                first, second = choice["weight_versions"]
                assert (first["version"], first["start"], second["version"]) == (1, 0, 2)
                assert 0 < first["end"] == second["start"] < second["end"] == len(choice["token_ids"])
                assert choice["token_ids"][: first["end"]] == reference["choices"][0]["token_ids"][: first["end"]]
                assert choice["weight_version"] == result["weight_version"] == 2
                assert choice["finish_reason"] in ("length", "stop")
            if mode != "keep":  # one version: one span over every token
                assert choice["weight_versions"] == [{"version": 1, "start": 0, "end": len(choice["token_ids"])}]


@pytest.mark.fault(
    "a push during a user's pause, then resume",
    expected="the push lands while paused; the pause holds until /resume; the parked request resumes on the new version",
)
def test_a_user_pause_outlasts_a_sync(tiny_models, observe) -> None:
    model_dir = tiny_models["qwen2"]
    v1 = load_file(model_dir / "model.safetensors")
    with live_server(model_dir) as server, WeightSender([server.address], timeout=WAIT_S) as sender:
        assert sender.push(v1, 1).ok
        assert server.client.pause("keep")["parked"]
        threads, results = run_concurrently(server, [[1, 2]])
        assert wait_until(lambda: server.server.loop.num_pending == 1)
        assert sender.push(v1, 2).ok
        assert server.server.loop.num_pending == 1 and server.client.weight_info()["paused_by"] == {"user": "keep"}
        server.client.resume()
        threads[0].join(WAIT_S)
        assert results[0]["weight_version"] == 2
        observe(
            "push of version 2 committed while paused (keep); still paused_by user after it; the parked request finished on version 2 after /resume"
        )
