"""Hostile HTTP input: whatever JSON a client sends to the rollout server's endpoints (completions
and chat, streamed or not), the answer is a clear 4xx (or a completion), never a 500, and the
server keeps serving; and nothing a peer can reach unpickles."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import live_server

SRC = Path(__file__).resolve().parents[2] / "src" / "weightsync"

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    ["prompt", "max_tokens", "temperature", "top_p", "seed", "n", "logprobs", "stop", "stop_token_ids", "model"]
)
bodies = st.dictionaries(fields, json_values, max_size=6) | json_values


@pytest.fixture(scope="module")
def server(tiny_models):  # type: ignore[no-untyped-def]
    with live_server(tiny_models["qwen2"], load_format="auto") as server:
        yield server


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_completions_never_fail_with_a_server_error(server, body) -> None:
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] <= 512:
        body["max_tokens"] = min(body["max_tokens"], 4)  # keep generation short; longer than the context: 400
    if isinstance(body, dict) and isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 2)
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code in (200, 400, 404), (body, response.status_code, response.text[:300])
    assert "error" in response.json() or response.json()["weight_version"] == 0


chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | json_values},
        optional={"content": st.text(max_size=20) | json_values},
    ),
    max_size=3,
)
chat_optional = ["max_tokens", "max_completion_tokens", "temperature", "n", "logprobs", "top_logprobs", "stop"]
chat_bodies = st.fixed_dictionaries(
    {"messages": chat_messages | json_values},
    optional={field: json_values for field in chat_optional}
    | {"stream": st.booleans(), "stream_options": json_values, "model": json_values},
) | st.lists(chat_messages, max_size=2)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_chat_never_fails_with_a_server_error(server, body) -> None:
    """The same for chat, streamed or not: a streamed 200 ends in [DONE] without an error event."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and body[field] <= 512:
                body[field] = min(body[field], 4)
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], 2)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code in (200, 400, 404), (body, response.status_code, response.text[:300])
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and not any(e.startswith('data: {"error"') for e in events), events
    else:
        assert "error" in response.json() or response.json()["weight_version"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.text(max_size=12) | st.just("wait"),
    timeout=st.text(max_size=8) | st.floats(allow_nan=False, allow_infinity=False),
)
def test_pause_resume_never_fail_with_a_server_error(server, mode, timeout) -> None:
    response = httpx.post(f"{server.url}/pause", params={"mode": mode, "timeout": timeout}, timeout=30)
    assert response.status_code in (200, 400), response.text[:300]
    assert httpx.post(f"{server.url}/resume", timeout=30).status_code == 200
    assert server.client.health()["status"] == "ok"


def test_a_completion_longer_than_the_context_is_refused_not_run(server) -> None:
    """Found by schemathesis: a huge max_tokens used to keep the engine generating (and its KV
    cache growing) without end. The model's context bounds prompt + completion, as in vLLM."""
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 2**40}, timeout=30)
    assert response.status_code == 400 and "max_model_len 512" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 511}, timeout=30)
    assert response.status_code == 400, "2 prompt tokens + 511 > 512"
    assert server.client.health()["status"] == "ok"


PICKLE_WRITERS = {"integrations/sglang/control.py"}
"""Modules that may import pickle to write one, never to read one: SGLang's own
update_weights_from_tensor takes a pickled body (read by SGLang's restricted unpickler), which
weightsync makes from a control message alone."""


def test_nothing_in_the_package_unpickles() -> None:
    """No pickle, marshal or shelve import (but to write SGLang's request body), no unpickling
    call, and no torch.load without weights_only=True, anywhere in the package. (The benchmarks,
    whose pickled-queue baseline and worker pipes stay between their own processes, are a
    package of their own: benchmarks/weightsync_bench.)"""
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        writer = str(path.relative_to(SRC)) in PICKLE_WRITERS
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                forbidden = {"marshal", "shelve", "dill", "cloudpickle"} | (set() if writer else {"pickle"})
                assert not forbidden & set(names), path
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads", "Unpickler"):
                assert getattr(node.value, "id", None) != "pickle", f"{path}: unpickles"
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load":
                owner = getattr(node.func.value, "id", None)
                if owner == "torch":
                    assert any(k.arg == "weights_only" for k in node.keywords), path
