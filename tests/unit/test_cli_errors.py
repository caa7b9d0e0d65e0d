"""The `weightsync` command's one error mapping: every failure is one line on stderr and an exit
status (2 usage, 130 Ctrl-C, 1 anything else), never a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from weightsync import cli
from weightsync.cli import push
from weightsync.errors import BenchError, ConfigError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """main's exit status (argparse's own exit included) and what it wrote to stderr; "bench"
    runs the benchmarks' own command, `weightsync-bench`."""
    from weightsync_bench import cli as bench_cli

    main, argv = (bench_cli.main, argv[1:]) if argv[:1] == ("bench",) else (cli.main, argv)
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = int(exc.code or 0)
    return status, capsys.readouterr().err


def assert_one_line(err: str) -> None:
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@contextlib.contextmanager
def http_service(status: int, body: bytes, content_type: str) -> Iterator[str]:
    """Something that is not a weightsync server, answering every GET the same way."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_dead_port_is_waited_for_a_bounded_while_then_one_line_and_status_1(capsys, tmp_path):
    started = time.monotonic()
    status, err = run(capsys, "push", "--model", str(tmp_path), "--to", "http://127.0.0.1:9", "--timeout", "2")
    waited = time.monotonic() - started
    waiting, failed = err.strip().splitlines()
    assert waiting.startswith("weightsync push: waiting up to 2 s for http://127.0.0.1:9: ")
    assert status == 1 and failed.startswith("weightsync push: ") and "Connection refused" in failed
    assert waited < 30, "the wait is bounded"


def test_a_service_that_is_not_weightsync_is_named(capsys, tmp_path):
    with http_service(200, b"<html><body>hello</body></html>", "text/html") as url:
        status, err = run(capsys, "push", "--model", str(tmp_path), "--to", url, "--timeout", "5")
    assert status == 1 and "is it a weightsync server?" in err
    assert_one_line(err)
    with http_service(200, json.dumps({"hello": "world"}).encode(), "application/json") as url:
        status, err = run(capsys, "digest", "--to", url, "--timeout", "5")
    assert status == 1 and "not a weightsync rollout server" in err
    assert_one_line(err)


def test_a_401_says_how_to_give_the_token(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_AUTH_TOKEN", raising=False)
    refused = {"error": {"message": "missing or wrong auth token (Authorization: Bearer ...)", "code": 401}}
    with http_service(401, json.dumps(refused).encode(), "application/json") as url:
        status, err = run(capsys, "push", "--model", str(tmp_path), "--to", url, "--timeout", "5")
    assert status == 1 and "HTTP 401" in err and "--auth-token" in err and "$WEIGHTSYNC_AUTH_TOKEN" in err
    assert_one_line(err)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["push", "--model", "m", "--to", "http://127.0.0.1:9", "--timeout", "0"], "--timeout"),
        (["push", "--model", "m", "--to", "http://127.0.0.1:9", "--version", "-1"], "--version"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--group", "1"], "--group"),
        (["bench", "--repeat", "0"], "--repeat"),
        (["bench", "--link", "10gigs"], "--link"),
        (["serve", "--model", "m", "--port", "70000"], "--port"),
        (["digest", "--timeout", "-1"], "--timeout"),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it(capsys, argv, flag):
    status, err = run(capsys, *argv)
    assert status == 2 and f"argument {flag}:" in err and "Traceback" not in err


def test_a_config_error_is_a_usage_error(capsys):
    status, err = run(capsys, "digest")
    assert status == 2 and err.startswith("weightsync digest: give --to")
    assert_one_line(err)


def test_a_link_run_over_shared_memory_is_refused(capsys):
    status, err = run(capsys, "bench", "--link", "10gbit", "--transport", "shm")
    assert status == 2 and "--link measures transports that cross a network" in err and "not shm" in err
    assert_one_line(err)


def test_a_lora_rank_without_lora_is_refused_not_ignored(capsys):
    status, err = run(capsys, "demo", "--lora-rank", "4")
    assert status == 2 and err.startswith("weightsync demo: --lora-rank applies to a LoRA run: add --lora")
    assert_one_line(err)


@pytest.mark.parametrize(
    ("raised", "status", "says"),
    [
        (KeyboardInterrupt(), 130, "weightsync push: interrupted"),
        (ConfigError("bad"), 2, "weightsync push: bad"),
        (
            BenchError("receiver process 7 failed:\nTraceback (most recent call last):\n  ...\nValueError: boom"),
            1,
            "ValueError: boom",
        ),
        (FileNotFoundError(2, "No such file or directory", "x"), 1, "No such file or directory"),
        (ModuleNotFoundError("No module named 'httpx'", name="httpx"), 1, "pip install -e '.[server]'"),
        (KeyError("surprise"), 1, "unexpected KeyError: 'surprise' (weightsync --traceback push"),
    ],
    ids=["ctrl-c", "config", "remote-traceback", "os", "missing-package", "unexpected"],
)
def test_every_error_is_one_line_and_a_status(capsys, monkeypatch, raised, status, says):
    def fail(args: object) -> int:
        raise raised

    monkeypatch.setattr(push, "run", fail)
    code, err = run(capsys, "push", "--model", "m", "--to", "http://127.0.0.1:9")
    assert code == status and says in err, err
    assert_one_line(err)


def test_traceback_flag_lets_the_error_through(monkeypatch):
    def fail(args: object) -> int:
        raise KeyError("surprise")

    monkeypatch.setattr(push, "run", fail)
    with pytest.raises(KeyError):
        cli.main(["--traceback", "push", "--model", "m", "--to", "http://127.0.0.1:9"])


def test_serve_with_vllm_missing_points_at_the_install_script(tmp_path):
    """Checked before the port is taken or the model loaded; a vllm that does not import stands in
    for one that is not installed (this venv may have it)."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    done = subprocess.run(
        [sys.executable, "-m", "weightsync", "serve", "--engine", "vllm", "--model", str(model), "--port", "0"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), SRC])},
        timeout=120,
    )
    assert done.returncode == 2 and "scripts/install-vllm.sh" in done.stderr, done.stderr
    assert_one_line(done.stderr)


@contextlib.contextmanager
def silent_service() -> Iterator[str]:
    """A port that accepts connections and never answers."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_a_server_that_does_not_answer_in_time_is_one_line(capsys, tmp_path):
    with silent_service() as url:
        status, err = run(capsys, "push", "--model", str(tmp_path), "--to", url, "--timeout", "0.5")
    assert status == 1 and err.startswith(f"weightsync push: {url}: ") and "timed out" in err, err
    assert_one_line(err)


def test_version(capsys):
    from weightsync import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"weightsync {__version__}\n"


def test_demo_with_vllm_missing_names_the_flag_and_the_install_script(capsys, monkeypatch):
    """Used to start the servers and blame "did not start listening within 60 s" after 10 s."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    status, err = run(capsys, "demo", "--engine", "vllm")
    assert status == 2 and err.startswith("weightsync demo: --engine vllm: vLLM is not installed here")
    assert "scripts/install-vllm.sh" in err and "--engine hf" in err
    assert_one_line(err)
