"""The README's trainer program, run exactly as the README prints it, against a real hf server:
a bf16 server commits every push; a float32 one refuses the bf16 cast, and the program stops on
a one-line SyncFailed that names the fix."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from tests.server.conftest import live_server
from weightsync import SyncFailed

README = Path(__file__).resolve().parents[2] / "README.md"


def trainer_program(tmp_path: Path) -> Path:
    """The python block after "Trainer side, in your own loop", written to a file as it stands."""
    text = README.read_text()
    after = text.split("Trainer side, in your own loop", 1)[1]
    block = after.split("```python\n", 1)[1].split("```\n", 1)[0]
    path = tmp_path / "train.py"
    path.write_text(block)
    return path


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
