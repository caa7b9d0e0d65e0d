"""Every code block of README.md, docs/integrations/vllm.md, docs/integrations/trl.md and
docs/lora.md is run as written by a named test, or is a diagram fenced as `text`, or says in its
own first line that it needs GPUs or several hosts, or is a set-up line checked here against what
it installs (tests/doc_snippets.py holds the table). Nothing is skipped silently."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import tomllib

import pytest

from tests.doc_snippets import DIAGRAM, DOCS, NEEDS_HARDWARE, ROOT, SET_UP, SNIPPETS, Snippet, iter_all

ALL = list(iter_all())


def test_every_block_is_in_the_table_and_the_table_names_only_blocks() -> None:
    found = {s.key for s in ALL}
    assert sorted(found - SNIPPETS.keys()) == [], "blocks no test runs and no mark explains: add them to SNIPPETS"
    assert sorted(SNIPPETS.keys() - found) == [], "SNIPPETS names blocks the docs no longer have"


@pytest.mark.parametrize("block", ALL, ids=lambda s: f"{s.doc}:{s.line}")
def test_each_block_is_what_the_table_says(block: Snippet) -> None:
    kind = SNIPPETS[block.key]
    marked = block.first_line.startswith("# Needs ")
    if kind == DIAGRAM:
        assert block.language == "text", f"{block.doc}:{block.line}: a diagram is fenced as text, not code"
    elif kind == NEEDS_HARDWARE:
        assert marked and re.search(r"\bGPU|\bhosts?\b", block.first_line), (
            f"{block.doc}:{block.line}: a block no test runs says what it needs in its first line ('# Needs a GPU...')"
        )
    elif kind == SET_UP:
        assert_set_up(block)
    else:
        assert not marked, f"{block.doc}:{block.line} is run by {kind}: it needs no hardware mark"
        assert block.language in ("python", "bash"), f"{block.doc}:{block.line}: fence it as python or bash"
        assert_runs_it(kind, block)


def assert_runs_it(test_id: str, block: Snippet) -> None:
    """`test_id` is a test function that exists and reads `block` from its doc by its heading."""
    path, name = test_id.split("::")
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, test_id
    assert os.path.basename(block.doc) in source, f"{path} does not read {block.doc}"
    assert block.heading in source, f"{path} does not name the heading {block.heading!r}"


def assert_set_up(block: Snippet) -> None:
    """A set-up block: `pip install -e '.[extra]'` of an extra the project has (and its pin as
    the comment says, as installed here), or a script of this checkout that skips what is done."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for line in block.text.strip().splitlines():
        command, _, comment = line.partition("#")
        if pip := re.fullmatch(r"pip install -e '\.\[(\w+)\]'", command.strip()):
            extra = extras[pip.group(1)]
            for package, version in re.findall(r"pins (\S+)==(\S+)", comment):
                assert f"{package}=={version}" in extra, (line, extra)
                assert importlib.metadata.version(package) == version, line
        elif script := re.fullmatch(r"\./(scripts/[\w-]+\.sh)", command.strip()):
            text = (ROOT / script.group(1)).read_text()
            assert os.access(ROOT / script.group(1), os.X_OK), line
            # a rerun skips what is done: the script says so, or leaves set-up to setup.sh (test_setup_script)
            assert "already installed" in text or "./scripts/setup.sh\n" in text, f"{line}: a rerun must skip"
        else:
            raise AssertionError(f"{block.doc}:{block.line}: {line!r} is not a set-up line; run it in a test")


@pytest.mark.parametrize("doc", DOCS)
def test_no_indented_code_blocks(doc: str) -> None:
    """An indented block (4 spaces after a paragraph) is code the table cannot see: fence it."""
    lines = (ROOT / doc).read_text().splitlines()
    fenced = False
    for number, (before, line) in enumerate(zip(["", *lines], lines, strict=False), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        starts_block = line.startswith("    ") and line.strip() and not before.strip()
        assert fenced or not starts_block or in_list(lines, number - 1), f"{doc}:{number}: {line!r}"


def in_list(lines: list[str], index: int) -> bool:
    """Whether line `index` continues a list item (the nearest unindented line above is one)."""
    for line in reversed(lines[:index]):
        if line.strip() and not line.startswith(" "):
            return bool(re.match(r"([-*]|\d+\.) ", line))
    return False
