"""The README's Python programs, run exactly as the README prints them. The trainer, against a
real hf server: a bf16 server commits every push; a float32 one refuses the bf16 cast, and the
program stops on a one-line SyncFailed that names the fix. The quick start, in this process. The
embedding-sized buckets, against a real hf server: the embedding travels in one bucket."""

from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path

import pytest

from tests.doc_snippets import run_shell, shell_script, snippet, weightsync_on_path, write_program
from tests.helpers import free_port
from tests.server.conftest import live_server
from weightsync import SyncFailed


def trainer_program(tmp_path: Path) -> Path:
    """The trainer ("Trainer side, in your own loop"), written to a file as it stands."""
    return write_program("README.md", "### Next: serve the policy you trained", tmp_path / "train.py", index=1)


def run(program: Path, model: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(program), str(model), url])
    runpy.run_path(str(program), run_name="__main__")


def test_the_readme_trainer_commits_on_a_bf16_server(tiny_models, tmp_path, monkeypatch, capsys) -> None:
    program = trainer_program(tmp_path)
    model = tiny_models["llama"]  # bfloat16: the program's cast matches
    with live_server(model) as server:
        run(program, model, server.url, monkeypatch)
        assert server.client.weight_info()["version"] == 3
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" committed on ")[0] for line in lines] == ["version 1", "version 2", "version 3"], lines
    assert all(" committed on 1 of 1 receivers (full): " in line for line in lines), lines


def test_the_readme_trainer_stops_on_a_float32_server_with_the_fix(tiny_models, tmp_path, monkeypatch) -> None:
    program = trainer_program(tmp_path)
    model = tiny_models["qwen2"]  # float32: the program's bf16 push is refused
    with live_server(model) as server, pytest.raises(SyncFailed) as failed:
        run(program, model, server.url, monkeypatch)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"version 1 did not commit on 1 of 1 receivers: {server.address}: PlanError: ")
    assert message.endswith("push float32 (cast=torch.float32, or no cast) or serve a bfloat16 model"), message


def test_the_readme_quick_start_runs_as_written(tmp_path, monkeypatch, capsys) -> None:
    program = write_program("README.md", "## Quick start", tmp_path / "quick_start.py")
    monkeypatch.setattr(sys, "argv", [str(program)])
    runpy.run_path(str(program), run_name="__main__")
    address, summary = capsys.readouterr().out.splitlines()
    assert address.startswith("shm://"), address
    assert summary.startswith("version 1 committed on 1 of 1 receivers (full): ") and summary.endswith(" 1"), summary


def test_the_readme_min_bucket_program_keeps_the_embedding_whole(tiny_models, tmp_path, monkeypatch, capsys) -> None:
    program = write_program("README.md", "## Quick start", tmp_path / "push_whole_embedding.py", index=1)
    model = tiny_models["qwen2"]  # float32, as the program pushes
    with live_server(model) as server:
        monkeypatch.setattr(sys, "argv", [str(program), str(model), server.url])
        names = runpy.run_path(str(program), run_name="__main__")
        assert server.client.weight_info()["version"] == 1
    config = names["config"]
    assert names["report"].bucket_bytes >= config.vocab_size * config.hidden_size * 4
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("version 1 committed on 1 of 1 receivers (full): ") and line.endswith(" True"), line


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_readme_rollout_server_commands_run_as_written(tiny_models, tmp_path) -> None:
    """`weightsync serve --engine vllm`, push, digest, as the README's block says them."""
    model, port = tiny_models["qwen2"], free_port()
    script = shell_script(
        snippet("README.md", "## Rollout server"),
        {"DIR": str(model), "CHECKPOINT_DIR": str(model)} | {"8000": str(port)},
    )
    done = run_shell(script, cwd=tmp_path, path=weightsync_on_path(tmp_path / "bin"), timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "version 1: committed on 1 of 1 servers" in done.stdout, done.stdout
    assert re.search(r"version 1 [0-9a-f]{32} match", done.stdout), done.stdout
