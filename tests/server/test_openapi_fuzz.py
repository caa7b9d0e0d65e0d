"""Schemathesis against the server's own OpenAPI spec: generated requests for every read and
generation endpoint (coverage and fuzzing phases, a fixed seed and a bounded count), none may
get a 500. /pause and /resume are left to test_hostile_http.py, which pairs them: a pause left
in place would hold every later request. Run as the `st` command, not its pytest plugin."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import live_server

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow

EXAMPLES = 25
"""Per operation and phase; the run takes about 15 s on our 2-core machine."""


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose context is 32 tokens: every completion schemathesis can ask for is
    cheap (n up to 128 times at most 32 tokens), so the run's length does not depend on luck."""
    from transformers import AutoModelForCausalLM

    from tests.models import model_config, save_tokenizer

    path = tmp_path_factory.mktemp("openapi") / "qwen2-short"
    config = model_config("qwen2")
    config.max_position_embeddings = 32
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    save_tokenizer(path)
    return path


def test_no_generated_request_gets_a_server_error(short_context_model, tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert st, "schemathesis is installed but its `st` command is not on the path"
    with live_server(short_context_model, load_format="auto") as server:
        done = subprocess.run(
            [
                st,
                "run",
                f"{server.url}/openapi.json",
                f"--max-examples={EXAMPLES}",
                "--seed=1",
                "--generation-deterministic",
                "--checks=not_a_server_error",
                "--exclude-path-regex=^/(pause|resume)$",
                "--phases=examples,coverage,fuzzing",
                "--request-timeout=60",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # st keeps a cache of what it found in its working directory
        )
        report = done.stdout[-4000:] + done.stderr[-2000:]
        assert done.returncode == 0, report
        assert "No issues found" in done.stdout, report
        assert server.client.health()["status"] == "ok", "the server still serves after the run"
