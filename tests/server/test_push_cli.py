"""`weightsync push` behaves like `WeightSender.push`: per-server results, the reachable servers
pushed to, a non-zero status when any failed, each error once and no success line before it;
`--cast`; and no move back to an older version, silent or not, unless asked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import ENGINES
from tests.server.conftest import live_server
from weightsync import PlanError, SyncFailed, WeightSender, cli
from weightsync.errors import one_line

DEAD = "http://127.0.0.1:9"


def push(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = cli.main(["push", *argv, "--timeout", "10"])
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.fault(
    "unreachable server in a multi-server push (`weightsync push --to LIVE DEAD`)",
    expected="the live server commits; the dead one is waited for a bounded while (one line says so), then "
    "one line on stderr; the summary comes last and says 1 of 2; exit status 1; no traceback",
)
def test_a_dead_server_does_not_stop_the_push_to_the_others(tiny_models, capsys, observe) -> None:
    model = tiny_models["qwen2"]
    with live_server(model) as server:
        status, out, err = push(capsys, "--model", str(model), "--to", server.url, DEAD)
        assert status == 1, (out, err)
        assert server.client.weight_info()["version"] == 1
        waiting, failed = err.strip().splitlines()
        assert waiting.startswith("weightsync push: waiting up to ") and f" for {DEAD}: " in waiting, err
        assert failed.startswith(f"weightsync push: {DEAD}: ") and "Connection refused" in failed, err
        assert "Traceback" not in err
        lines = out.strip().splitlines()
        assert lines[0] == f"{server.url}: committed version 1", out
        assert lines[-1].startswith("version 1: committed on 1 of 2 servers; "), out
    observe(f"exit 1; stdout `{lines[0]}` then `{lines[-1][:40]}...`; stderr `{failed[:90]}`")


def test_a_failed_push_reports_each_server_once_and_fails(tiny_models, capsys) -> None:
    qwen, llama = tiny_models["qwen2"], tiny_models["llama"]
    with live_server(qwen) as good, live_server(llama) as other:  # llama's weights do not fit a qwen2 server
        status, out, err = push(capsys, "--model", str(qwen), "--to", good.url, other.url)
    assert status == 1
    failed = err.strip().splitlines()
    assert len(failed) == 1 and failed[0].startswith(f"weightsync push: {other.url}: PlanError: "), err
    lines = out.strip().splitlines()
    assert lines[0] == f"{good.url}: committed version 1" and len(lines) == 2, out
    assert lines[1].startswith("version 1: committed on 1 of 2 servers"), out


def test_an_older_version_needs_allow_older_version(tiny_models, capsys) -> None:
    model = tiny_models["qwen2"]
    with live_server(model) as server:
        assert push(capsys, "--model", str(model), "--to", server.url, "--version", "11")[0] == 0
        status, out, err = push(capsys, "--model", str(model), "--to", server.url, "--version", "3")
        assert status == 2 and out == "", (out, err)
        assert "--version 3 is lower than version 11" in err and "--allow-older-version" in err
        assert len(err.strip().splitlines()) == 1
        assert server.client.weight_info()["version"] == 11
        flags = ("--version", "3", "--allow-older-version")
        assert push(capsys, "--model", str(model), "--to", server.url, *flags)[0] == 0
        assert server.client.weight_info()["version"] == 3


@pytest.mark.fault(
    "a push labelled at or below the last committed version, to a ready and to a dirty server",
    expected="refused before a byte moves, one line naming both versions; the previous weights serve on "
    "(a dirty server stays dirty); `weightsync push` without --version pushes the last committed + 1",
)
def test_a_server_never_takes_an_older_version_even_while_dirty(tiny_models, capsys, observe) -> None:
    from tests.server.checks import PROMPT, _Gated

    model = tiny_models["qwen2"]
    weights = load_file(model / "model.safetensors")
    with live_server(model) as server, WeightSender([server.address], timeout=10, bucket_bytes=1 << 12) as sender:
        assert push(capsys, "--model", str(model), "--to", server.url, "--version", "5")[0] == 0
        before = server.client.completions(PROMPT, max_tokens=8, temperature=0)["choices"][0]["token_ids"]
        with pytest.raises(SyncFailed, match="version 3 is not above version 5, committed here last") as refused:
            sender.push({name: tensor * 2 for name, tensor in weights.items()}, 3)
        after = server.client.completions(PROMPT, max_tokens=8, temperature=0)
        assert after["weight_version"] == 5 and after["choices"][0]["token_ids"] == before
        assert server.client.health()["status"] == "ok"
        with pytest.raises(PlanError):  # the source breaks after some buckets reached the live weights
            sender.push(_Gated(weights, broken=True), 6)
        info = server.client.weight_info()
        assert (info["state"], info["version"], info["last_committed"]) == ("dirty", None, 5), info
        with pytest.raises(SyncFailed, match="versions only go forward"):
            sender.push(weights, 1)
        assert server.client.weight_info()["state"] == "dirty"
        status, out, err = push(capsys, "--model", str(model), "--to", server.url, "--version", "5")
        assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
        assert f"--version 5 is the same as version 5, which {server.url} committed last" in err
        status, out, err = push(capsys, "--model", str(model), "--to", server.url)
        assert status == 0 and out.splitlines()[0] == f"{server.url}: committed version 6", (out, err)
        assert server.client.health()["status"] == "ok"
    observe(f"`{one_line(refused.value)[:110]}...`; version 5 served on, same tokens; dirty: refused too")


def test_cast_pushes_a_bfloat16_checkpoint_into_a_float32_server(tiny_models, tmp_path, capsys) -> None:
    served = tiny_models["qwen2"]  # float32
    checkpoint = tmp_path / "bf16"
    checkpoint.mkdir()
    tensors = load_file(served / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, checkpoint / "model.safetensors")
    shutil.copy(served / "config.json", checkpoint / "config.json")
    with live_server(served) as server:
        status, out, err = push(capsys, "--model", str(checkpoint), "--to", server.url)
        assert status == 1 and "Traceback" not in err, err
        # the refusal, once, on one line of stderr, naming the fix; the summary moves no bytes
        (refused,) = err.strip().splitlines()
        assert refused.startswith(f"weightsync push: {server.url}: PlanError: the push sends bfloat16 "), err
        assert refused.endswith("push float32 (--cast float32, or no cast) or serve a bfloat16 model"), err
        assert out.strip().splitlines() == [
            "version 1: committed on 0 of 1 servers: refused (PlanError, the reason is on stderr); no weights moved"
        ], out
        status, out, err = push(capsys, "--model", str(checkpoint), "--to", server.url, "--cast", "float32")
        assert status == 0, err
        assert server.client.weight_info()["version"] == 1 and "committed on 1 of 1" in out


def test_json_lists_unreachable_servers_too(tiny_models, capsys) -> None:
    import json

    model = tiny_models["qwen2"]
    with live_server(model) as server:
        status, out, _ = push(capsys, "--model", str(model), "--to", server.url, DEAD, "--json")
    report = json.loads(out)
    assert status == 1 and report["ok"] is False and report["version"] == 1
    by_url = {o["url"]: o for o in report["outcomes"]}
    assert by_url[server.url]["committed"] and not by_url[DEAD]["committed"]
    assert by_url[DEAD]["kind"] == "ServerError" and "Connection refused" in by_url[DEAD]["error"]


def test_every_server_unreachable(capsys, tmp_path: Path) -> None:
    status, out, err = push(capsys, "--model", str(tmp_path), "--to", DEAD, "http://127.0.0.1:1")
    assert status == 1 and out == ""
    failed = [line for line in err.strip().splitlines() if not line.startswith("weightsync push: waiting")]
    assert [line.split(": ")[1] for line in failed] == [DEAD, "http://127.0.0.1:1"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_push_started_while_the_server_starts_commits_once_it_is_up(tiny_models, tmp_path, engine) -> None:
    """The server's process is started and the push at once: the port refuses connections, then
    answers 503 while the engine loads (vLLM's takes 25-75 s here); the push waits (saying so on
    one line) and commits."""
    import os
    import socket
    import subprocess
    import sys

    from weightsync.client import RolloutClient
    from weightsync.serving.process import ChildProcess

    env = os.environ | {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}

    model = tiny_models["qwen2"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    serve = [
        sys.executable,
        "-m",
        "weightsync",
        "serve",
        "--engine",
        engine,
        "--model",
        str(model),
        "--port",
        str(port),
    ]
    server = ChildProcess(serve, env=env)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "weightsync", "push", "--model", str(model), "--to", url, "--timeout", "240"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.startswith(f"weightsync push: waiting up to 240 s for {url}: "), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert done.stdout.splitlines()[0] == f"{url}: committed version 1", done.stdout
        with RolloutClient(url) as client:
            assert client.weight_info()["version"] == 1
    finally:
        server.close()
