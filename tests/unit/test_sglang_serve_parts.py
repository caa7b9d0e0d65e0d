"""`weightsync serve --engine sglang`'s parts that need no SGLang: what it refuses before SGLang's
parser runs, the versions it records from SGLang's outputs, and the routes it keeps for itself.
(The whole server runs on real SGLang in tests/server/test_sglang_serve.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.models import save_model
from weightsync.errors import ConfigError
from weightsync.serving.config import ServeConfig
from weightsync.serving.labels import RECORDER, Recorder
from weightsync.serving.sglang.launch import sglang_args
from weightsync.serving.sglang.server import Owned
from weightsync.serving.sglang.versions import record_versions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sglang_parts") / "qwen2"
    save_model("qwen2", path)
    return path


@pytest.mark.parametrize(
    ("options", "extra", "why"),
    [
        ({}, ["--custom-weight-loader", "x.y"], "--custom-weight-loader is weightsync's own"),
        ({}, ["--api-key=secret"], "--api-key is weightsync's own"),
        ({}, ["--dp-size", "2"], "--dp-size is weightsync's own"),
        ({"sync_mode": "keep"}, [], "--sync-mode keep"),
        ({"max_lora_rank": 8}, [], "serves no LoRA adapters"),
    ],
)
def test_what_weightsync_owns_is_refused_before_sglang_parses(
    model_dir: Path, options: dict[str, Any], extra: list[str], why: str
) -> None:
    config = ServeConfig(model=str(model_dir), engine="sglang", **options)
    with pytest.raises(ConfigError, match=why):
        sglang_args(config, 8000, extra)


def _recorded(outputs: list[Any]) -> Recorder:
    """The recorder of one request whose engine call yields `outputs`."""

    class Manager:
        async def generate_request(self, obj: Any, request: Any = None) -> AsyncIterator[Any]:
            for output in outputs:
                yield output

    manager = Manager()
    record_versions(manager)
    recorder = Recorder()

    async def run() -> None:
        token = RECORDER.set(recorder)
        try:
            async for _ in manager.generate_request(None):
                pass
        finally:
            RECORDER.reset(token)

    asyncio.run(run())
    return recorder


def test_streamed_outputs_name_their_choice_and_its_spans_at_the_end() -> None:
    recorder = _recorded(
        [
            {"index": 1, "meta_info": {"weight_version": "3", "finish_reason": None}},
            {
                "index": 1,
                "meta_info": {
                    "weight_version": "4",
                    "finish_reason": {"type": "length"},
                    "completion_tokens": 5,
                    "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}],
                },
            },
        ]
    )
    assert recorder.newest == 4
    assert recorder.spans == {1: [{"version": 3, "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 5}]}


def test_a_batch_answers_every_choice_in_order_with_one_span_when_sglang_recorded_no_change() -> None:
    done = {"finish_reason": {"type": "stop"}, "weight_version": "7", "completion_tokens": 3}
    recorder = _recorded([[{"meta_info": done}, {"meta_info": done | {"completion_tokens": 2}}]])
    assert recorder.spans == {
        0: [{"version": 7, "start": 0, "end": 3}],
        1: [{"version": 7, "start": 0, "end": 2}],
    }


def test_sglangs_default_label_is_no_version() -> None:
    recorder = _recorded([{"meta_info": {"weight_version": "default", "finish_reason": None}}])
    assert recorder.newest is None and recorder.spans == {}


def test_sglangs_weight_routes_answer_403_and_others_pass() -> None:
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=Owned(inner))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/update_weights_from_disk", json={}), await client.post("/generate", json={})

    refused, passed = asyncio.run(run())
    assert refused.status_code == 403 and "weightsync owns this server's weights" in refused.json()["error"]["message"]
    assert passed.status_code == 200 and passed.text == "ok"
