"""Always answering: from the moment `weightsync serve` listens, /health and every endpoint answer
within 100 ms, with a 503 that names the state until the server is up; an oversized request is
refused before it is parsed or tokenised, and a long one is tokenised off the event loop."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers import WAIT_S, free_port, wait_until
from tests.server.test_cli import Served
from weightsync.serving.background import bind
from weightsync.serving.config import ServeConfig
from weightsync.serving.hf import server as runtime
from weightsync.serving.hf.engine import HFEngine
from weightsync.serving.hf.startup import Startup

SRC = str(Path(__file__).resolve().parents[2] / "src")

ANSWER_S = 0.1
"""The bound on every answer, from the moment the port listens."""

STRAY_S = 4.0
"""The dev machine is shared (2 cores, often 3-6 runnable processes): the scheduler alone delays a
probe now and then (1.1 s once at load 7 while vLLM loaded; 2.07 s once at load 4-5 with two test
runs beside it). One answer in 50 (and at least one, however few were probed) may take up to
this; the bug this guards against took 6-10 s on a quiet host."""


def assert_answered_in_time(answers: list[tuple[float, int, str]]) -> None:
    assert all(status for _, status, _ in answers), [state for _, status, state in answers if not status][:3]
    late = sorted(seconds for seconds, _, _ in answers if seconds >= ANSWER_S)
    assert len(late) <= max(1, len(answers) // 50) and all(s < STRAY_S for s in late), (
        f"{len(late)} of {len(answers)} answers took {ANSWER_S * 1e3:.0f} ms or more: "
        f"{[round(s * 1e3) for s in late]} ms"
    )


START_S = 300.0


class Prober:
    """Probes GET /health every 20 ms on a thread, once at least; records each answer's state and
    latency (a probe that got no answer: status 0). Stops when its `with` block ends, however it
    ends."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while True:  # one probe at least, however soon the block ends
                started = time.monotonic()
                try:
                    response = client.get(f"{self.url}/health")
                    answer = (response.status_code, response.json()["state"])
                except httpx.HTTPError as exc:
                    answer = (0, f"no answer: {type(exc).__name__}")
                self.answers.append((time.monotonic() - started, *answer))
                if self._stop.wait(0.02):
                    return

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[tuple[float, int, str]]:
        self._stop.set()
        self._thread.join(WAIT_S)
        return self.answers


def worst(answers: list[tuple[float, int, str]]) -> float:
    return max(seconds for seconds, _, _ in answers)


class SlowHFEngine(HFEngine):
    """The hf engine, built after `released` is set (an engine that takes its time to load)."""

    released = threading.Event()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        assert self.released.wait(WAIT_S * 3)
        if getattr(self, "fail", False):
            raise RuntimeError("this model does not load (injected)")
        super().__init__(*args, **kwargs)


@pytest.fixture
def slow_start(monkeypatch: pytest.MonkeyPatch, tiny_models: dict[str, Path]) -> Iterator[tuple[Startup, str]]:
    """A Startup behind uvicorn on a thread, whose engine builds only once released."""
    import uvicorn

    SlowHFEngine.released = threading.Event()
    monkeypatch.setattr(runtime, "build_engine", lambda config: SlowHFEngine(config.model))
    startup = Startup(ServeConfig(model=str(tiny_models["qwen2"])))
    sock = bind("127.0.0.1", 0)
    http = uvicorn.Server(uvicorn.Config(startup.front, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: http.started)
    startup.start(lambda: None)
    try:
        yield startup, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        SlowHFEngine.released.set()
        http.should_exit = True
        thread.join(WAIT_S)
        startup.close()
        sock.close()


def test_every_endpoint_answers_503_naming_the_state_while_the_engine_loads(slow_start) -> None:
    startup, url = slow_start
    with httpx.Client(base_url=url, timeout=5) as client:
        assert wait_until(lambda: client.get("/health").json()["state"] == "loading engine")
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["reason"].startswith("loading the hf engine for ")
        for method, path, body in [
            ("GET", "/weight_info", None),
            ("GET", "/metrics", None),
            ("GET", "/v1/models", None),
            ("POST", "/pause", None),
            ("POST", "/resume", None),
            ("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 1}),
        ]:
            started = time.monotonic()
            answer = client.request(method, path, json=body)
            assert time.monotonic() - started < ANSWER_S * 5  # generous: this one is about the state
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["state"] == "loading engine", (path, answer.text)
            assert answer.json()["error"]["message"].startswith("loading the hf engine"), (path, answer.text)
        SlowHFEngine.released.set()
        assert wait_until(lambda: client.get("/health").json()["state"] == "waiting for weights")
        assert client.get("/weight_info").status_code == 200


def test_an_engine_that_fails_to_load_is_named_failed(slow_start) -> None:
    startup, url = slow_start
    SlowHFEngine.fail = True  # type: ignore[attr-defined]
    try:
        SlowHFEngine.released.set()
        with httpx.Client(base_url=url, timeout=5) as client:
            assert wait_until(lambda: client.get("/health").json()["state"] == "failed")
            reason = client.get("/health").json()["reason"]
        assert reason == "the server could not start: this model does not load (injected)"
        assert startup.error is not None and startup.server is None
    finally:
        del SlowHFEngine.fail  # type: ignore[attr-defined]


ENGINES = [
    "hf",
    pytest.param(
        "vllm",
        marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_serve_answers_within_100ms_from_the_moment_it_listens(tiny_models, engine) -> None:
    port = free_port()
    command = [sys.executable, "-m", "weightsync", "serve", "--engine", engine, "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--model", str(tiny_models["qwen2"]), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        env=os.environ | {"PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:

        def listening() -> bool:
            assert process.poll() is None, "the server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.05).close()
            except OSError:
                return False
            return True

        assert wait_until(listening, timeout=START_S, interval=0.005)
        with Prober(f"http://127.0.0.1:{port}") as prober:
            assert wait_until(lambda: any(state == "waiting for weights" for _, _, state in prober.answers), START_S)
        answers = prober.answers
    finally:
        process.terminate()
        process.wait(WAIT_S)
    states = {state for _, _, state in answers}
    assert states <= {"starting", "loading engine", "waiting for weights"}, states
    assert all(status == 503 for _, status, _ in answers)
    assert_answered_in_time(answers)


def post_prompt(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)


@pytest.mark.fault(
    "huge prompt: 10 MB of text to `POST /v1/completions`",
    expected="refused with 413 before it is parsed or tokenised (default bound from the model's context, "
    "--max-request-bytes); /health answers within 100 ms meanwhile; the server's memory does not grow",
)
def test_a_huge_prompt_is_refused_before_it_is_read_whole(tiny_models, observe) -> None:
    served = Served(tiny_models["qwen2"], "--load-format", "auto", "--log-level", "warning")
    try:
        process = psutil.Process(served.process.pid)
        assert post_prompt(served.url, "ab").status_code == 200
        before = process.memory_info().rss
        with Prober(served.url) as prober:
            started = time.monotonic()
            refused = post_prompt(served.url, "a" * 10_000_000)
            seconds = time.monotonic() - started
        answers = prober.answers
        grown = process.memory_info().rss - before
        assert refused.status_code == 413, refused.text[:300]
        message = refused.json()["error"]["message"]
        assert "over this server's limit of 1048576 bytes" in message and "--max-request-bytes" in message
        assert_answered_in_time(answers)
        assert grown < 20e6, f"the server grew by {grown / 1e6:.0f} MB"
        assert post_prompt(served.url, "ab").status_code == 200
    finally:
        served.close()
    observe(
        f"413 in {seconds:.2f} s (`{message[:70]}...`); /health answered {len(answers)} times meanwhile, "
        f"slowest {worst(answers) * 1e3:.0f} ms; server RSS grew {grown / 1e6:.1f} MB; next request served"
    )


def test_a_long_prompt_is_tokenised_off_the_event_loop(tiny_models) -> None:
    served = Served(tiny_models["qwen2"], "--load-format", "auto", "--log-level", "warning")
    try:
        with Prober(served.url) as prober:
            refused = post_prompt(served.url, "ab" * 400_000)  # under the 1 MiB bound, far over the context
        answers = prober.answers
    finally:
        served.close()
    assert refused.status_code == 400 and "exceed the engine's max_model_len 512" in refused.text, refused.text
    assert_answered_in_time(answers)


def test_validation_errors_are_plain_messages(tiny_models) -> None:
    served = Served(tiny_models["qwen2"], "--load-format", "auto", "--log-level", "warning")
    try:
        answer = httpx.post(f"{served.url}/v1/completions", json={"prompt": "ab", "max_tokens": 0, "n": 0})
    finally:
        served.close()
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert message == (
        "max_tokens: Input should be greater than or equal to 1; n: Input should be greater than or equal to 1"
    ), message
