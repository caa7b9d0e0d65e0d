"""Completion options on the hf engine: stop strings, top logprobs, and their validation."""

from __future__ import annotations

import pytest

from tests.server.checks import check_stop_strings, check_top_logprobs
from tests.server.conftest import live_server
from weightsync.client import ServerError


@pytest.fixture(scope="module")
def server(tiny_models):  # type: ignore[no-untyped-def]
    with live_server(tiny_models["llama"], load_format="auto") as server:
        yield server


def test_stop_strings(server) -> None:
    check_stop_strings(server)


def test_top_logprobs_match_transformers(server) -> None:
    check_top_logprobs(server, server.server.engine.model)


def test_logprobs_zero_gives_no_alternatives(server) -> None:
    logprobs = server.client.completions([5, 6], max_tokens=3, temperature=0, logprobs=0)["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 3 and "top_logprobs" not in logprobs


@pytest.mark.parametrize("stop", ["", ["a", "b", "c", "d", "e"], [""]])
def test_bad_stop_strings_are_refused(server, stop) -> None:
    with pytest.raises(ServerError) as raised:
        server.client.completions("ab", max_tokens=2, stop=stop)
    assert raised.value.status == 400 and "stop" in str(raised.value)


def test_a_body_that_is_not_json_names_no_field() -> None:
    """pydantic locates a JSON syntax error by character ("17"): not a field, so no `param`."""
    from weightsync.serving.hf.app import first_field, plain

    error = {"type": "json_invalid", "loc": ("body", 17), "msg": "JSON decode error"}
    assert first_field([error]) is None
    assert plain([error]) == "body: not valid JSON (JSON decode error, at character 17)"


def test_a_malformed_json_body_is_refused_in_plain_words(server) -> None:
    import httpx

    response = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"prompt": "ab", ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None, error
    assert error["message"].startswith("body: not valid JSON"), error
