"""The code blocks of the docs whose every snippet CI runs as written, and what runs each one.

`SNIPPETS` names, for every fenced block of those docs (keyed by the heading it is under and its place there), the test that
runs it as written, or why it is not run: a diagram (fenced as `text`), a snippet that needs GPUs
or several hosts (it says so itself, in a first line that starts with `# Needs`), or a set-up
line checked against what it installs. `tests/unit/test_doc_snippets.py` holds the docs and this
table to each other, so a new block cannot go unclassified and a marked one cannot lose its mark.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DOCS = ["README.md", "docs/integrations/vllm.md", "docs/integrations/trl.md", "docs/lora.md"]
"""The docs whose every shell and Python snippet runs in CI as written."""

DIAGRAM = "diagram"
"""Not code: a picture in text, fenced as `text`."""
NEEDS_HARDWARE = "needs hardware"
"""Needs GPUs or several hosts: the block's first line says so (`# Needs ...`)."""
SET_UP = "set-up"
"""Sets up the environment the tests run in (pip, the checkout's scripts/*.sh): checked by
`tests/unit/test_doc_snippets.py` against what it installs, not run (it would reinstall the
package under the running tests; scripts/test.sh is what runs them)."""

SNIPPETS: dict[tuple[str, str, int], str] = {
    # (doc, the heading the block is under, its index under that heading): what runs it
    ("README.md", "# weightsync", 0): SET_UP,
    ("README.md", "# weightsync", 1): DIAGRAM,
    ("README.md", "### Next: serve the policy you trained", 0):
        "tests/demo/test_demo_outputs.py::test_the_readme_exercise_serves_pushes_and_checks_the_trained_policy",
    ("README.md", "### Next: serve the policy you trained", 1):
        "tests/server/test_readme.py::test_the_readme_trainer_commits_on_a_bf16_server",
    ("README.md", "## Quick start", 0): "tests/server/test_readme.py::test_the_readme_quick_start_runs_as_written",
    ("README.md", "## Quick start", 1):
        "tests/server/test_readme.py::test_the_readme_min_bucket_program_keeps_the_embedding_whole",
    ("README.md", "## Rollout server", 0):
        "tests/server/test_readme.py::test_the_readme_rollout_server_commands_run_as_written",
    ("README.md", "## A fleet on Ray", 0): "tests/fleet/test_readme_ray.py::test_the_readme_ray_program_runs_as_written",
    ("README.md", "## vLLM's own weight-transfer API", 0):
        "tests/integrations/test_vllm_backend.py::test_the_readme_server_command_is_the_docs",
    ("README.md", "## SGLang", 0): NEEDS_HARDWARE,
    ("README.md", "## SGLang", 1): NEEDS_HARDWARE,
    ("README.md", "## verl", 0): NEEDS_HARDWARE,
    ("README.md", "## TRL", 0): "tests/integrations/test_trl.py::test_the_docs_example_command_runs_as_written",
    # docs/integrations/vllm.md
    ("docs/integrations/vllm.md", "## The lines that change", 0):
        "tests/integrations/test_vllm_backend.py::test_the_docs_trainer_program_runs_as_written",
    ("docs/integrations/vllm.md", "## The lines that change", 1):
        "tests/integrations/test_vllm_backend.py::test_the_docs_trainer_program_runs_as_written",
    ("docs/integrations/vllm.md", "## One round, phase by phase", 0): DIAGRAM,
    ("docs/integrations/vllm.md", "## Mixture-of-experts models", 0):
        "tests/integrations/test_vllm_backend.py::test_the_docs_moe_program_runs_as_written",
    # docs/integrations/trl.md
    ("docs/integrations/trl.md", "# TRL: GRPO with weightsync rollout servers", 0): SET_UP,
    ("docs/integrations/trl.md", "# TRL: GRPO with weightsync rollout servers", 1):
        "tests/integrations/test_trl.py::test_the_docs_example_command_runs_as_written",
    ("docs/integrations/trl.md", "## The lines that change in a TRL script", 0):
        "tests/integrations/test_trl.py::test_the_docs_grpo_program_runs_as_written",
    ("docs/integrations/trl.md", "## AsyncGRPOTrainer: the weight-transfer protocol", 0): NEEDS_HARDWARE,
    # docs/lora.md
    ("docs/lora.md", "# LoRA adapters: only the adapter, in memory, one version at a time", 0): DIAGRAM,
    ("docs/lora.md", "## The trainer side", 0): "tests/server/test_lora.py::test_the_docs_trainer_program_runs_as_written",
    ("docs/lora.md", "### From the command line", 0):
        "tests/server/test_lora.py::test_the_docs_cli_push_runs_as_written",
    ("docs/lora.md", "## The server side", 0): "tests/server/test_lora.py::test_the_docs_trainer_program_runs_as_written",
    ("docs/lora.md", "## The server side", 1): "tests/server/test_lora.py::test_the_docs_trainer_program_runs_as_written",
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Snippet:
    """One fenced code block of a doc."""

    doc: str
    heading: str
    """The heading the block is under, as written (`## Quick start`)."""
    index: int
    """The block's place under that heading (0: the first)."""
    line: int
    """The fence's line number (1-based)."""
    language: str
    text: str

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.doc, self.heading, self.index)

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""


FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def snippets(doc: str) -> list[Snippet]:
    """Every fenced block of `doc` (a path relative to the checkout), in order."""
    found: list[Snippet] = []
    heading, under = "", 0
    start: tuple[int, str, str] | None = None  # the open fence: line, language, indent
    body: list[str] = []
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        match = FENCE.match(line)
        if start is None and match is None and line.startswith("#"):
            heading, under = line.strip(), 0
        elif match is None:
            if start is not None:
                body.append(line[len(start[2]) :] if line.startswith(start[2]) else line)
        elif start is None:
            start, body = (number, match.group(2), match.group(1)), []
        else:
            found.append(Snippet(doc, heading, under, start[0], start[1], "\n".join(body) + "\n"))
            start, under = None, under + 1
    return found


def snippet(doc: str, heading: str, index: int = 0) -> Snippet:
    """Block `index` under `heading` in `doc`."""
    matches = [s for s in snippets(doc) if (s.heading, s.index) == (heading, index)]
    if not matches:
        raise LookupError(f"{doc}: no block {index} under {heading!r}")
    return matches[0]


def write_program(doc: str, heading: str, path: Path, index: int = 0) -> Path:
    """Block `index` under `heading` in `doc`, written to `path` as it stands."""
    path.write_text(snippet(doc, heading, index).text)
    return path


def weightsync_on_path(directory: Path) -> Path:
    """A `weightsync` command in `directory` that runs this interpreter's weightsync, for shell
    blocks that say `weightsync ...` (or activate a venv that has it)."""
    directory.mkdir(parents=True, exist_ok=True)
    command = directory / "weightsync"
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m weightsync "$@"\n')
    command.chmod(0o755)
    return directory


def shell_script(block: Snippet, replace: Mapping[str, str]) -> str:
    """A shell block as one bash script, as written but for the words in `replace` (a placeholder
    such as DIR, the port 8000), with whatever it left running killed on exit."""
    script = ["trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for line in block.text.strip().splitlines():
        for word, value in replace.items():
            line = re.sub(rf"(?<![\w/.]){re.escape(word)}(?!\w)", value, line)
        script.append(line)
    return "\n".join(script)


def run_shell(script: str, cwd: Path, path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`script` under `bash -euo pipefail` in `cwd`, with `path` first on PATH."""
    env = os.environ | {"PATH": f"{path}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def iter_all() -> Iterator[Snippet]:
    for doc in DOCS:
        yield from snippets(doc)
