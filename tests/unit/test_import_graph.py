"""The package's import graph: no module imports itself back, and `import weightsync` pulls in
none of the optional stacks (engines, server, Ray).

The graph is read from the source with `ast`, never by importing it. An edge A -> B means that
importing A runs an import of B: a module-level `import weightsync.b`, `from weightsync.b import
x` or `from . import b`, also inside a module-level `if`, `try` or class body. Imports inside
functions run later, when called, and are left out: deferring an import is how a module breaks a
cycle or keeps an optional stack away. Imports under `if TYPE_CHECKING:` never run and are kept
apart. Importing a submodule also runs its parent packages' `__init__`, which is not an edge here:
every module would otherwise import the package root, and the root imports nearly everything.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import weightsync

PACKAGE = Path(weightsync.__file__).parent
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "weightsync_bench"
"""The benchmarks' package (`weightsync-bench`), shipped beside weightsync and never imported by it:
it imports weightsync, so an import the other way would be a cycle between the two packages."""

OPTIONAL = (
    "ray",
    "fastapi",
    "uvicorn",
    "transformers",
    "vllm",
    "httpx",
    "prometheus_client",
    "safetensors",
    "verl",
    "nixl",
    "nixl_cu12",
    "nixl_cu13",
)
"""Top-level packages of the optional extras ([server], [hf], [ray], [verl], [nixl], vLLM): `import
weightsync` needs only torch and the core dependencies."""


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_only: bool


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under `root` by dotted name, with its file; extension
    modules (.so) are named too, without a file to parse."""
    modules = {}
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".so") or "__pycache__" in path.parts:
            continue
        parts = [root.name, *path.relative_to(root).parent.parts]
        stem = path.name.split(".")[0]
        if stem != "__init__":
            parts.append(stem)
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt], type_only: bool = False):  # type: ignore[no-untyped-def]
    """(import statement, type_only) for each import that runs when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs when called, not when imported
        elif isinstance(node, ast.If):
            yield from _module_level_imports(node.body, type_only or _is_type_checking(node.test))
            yield from _module_level_imports(node.orelse, type_only)
        else:  # class bodies, try/except/else/finally, with, for, while, match
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level_imports(getattr(node, field, []), type_only)
            for block in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
                yield from _module_level_imports(block.body, type_only)


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The package's modules that import statement `node` in module `name` imports."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
        candidates = [
            f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin for alias in node.names
        ]
    return [target for target in dict.fromkeys(candidates) if target in modules]


def import_edges(root: Path) -> list[Edge]:
    """Every import edge between the modules of the package under `root`."""
    modules = module_names(root)
    edges = []
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, type_only in _module_level_imports(tree.body):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                if target != name:
                    edges.append(Edge(name, target, node.lineno, type_only))
    return edges


def find_cycle(edges: list[Edge]) -> list[Edge]:
    """The edges of one cycle in the graph, in order, or [] if it has none (iterative DFS)."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        stack = [(start, iter(graph[start]))]  # the DFS path: each node with its edges left to try
        path: list[Edge] = []  # path[k] leads from stack[k] to stack[k + 1]
        while stack:
            node, out = stack[-1]
            edge = next(out, None)
            if edge is None:
                done.add(node)
                stack.pop()
                if path:
                    path.pop()
                continue
            on_path = [name for name, _ in stack]
            if edge.target in on_path:
                return [*path[on_path.index(edge.target) :], edge]
            if edge.target not in done:
                path.append(edge)
                stack.append((edge.target, iter(graph.get(edge.target, []))))
    return []


def describe(cycle: list[Edge], modules: dict[str, Path]) -> str:
    root = modules[next(iter(modules)).split(".")[0]].parent.parent  # the package's __init__.py, up two
    steps = [f"{e.source} -> {e.target}  ({modules[e.source].relative_to(root)}:{e.line})" for e in cycle]
    return "import cycle:\n  " + "\n  ".join(steps)


def reachable(edges: list[Edge], start: str) -> dict[str, list[str]]:
    """Every module that importing `start` runs, with the chain of imports that gets there.
    Runtime edges only, plus the parent packages a submodule import runs."""
    graph: dict[str, list[str]] = {}
    for edge in edges:
        if not edge.type_only:
            graph.setdefault(edge.source, []).append(edge.target)
    for edge in edges:
        parts = edge.target.split(".")
        for depth in range(1, len(parts)):
            graph.setdefault(edge.target, []).append(".".join(parts[:depth]))
    chains = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for target in graph.get(node, []):
            if target not in chains:
                chains[target] = [*chains[node], target]
                frontier.append(target)
    return chains


def optional_imports(path: Path) -> list[tuple[str, int]]:
    """The optional stacks a module imports at module level (type-only imports aside), with the line."""
    if path.suffix != ".py":
        return []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node, type_only in _module_level_imports(tree.body):
        if type_only or (isinstance(node, ast.ImportFrom) and node.level):
            continue
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        found += [(name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in OPTIONAL]
    return found


def optional_stacks_on_import(root: Path) -> list[str]:
    """Each module-level import of an optional stack that importing the package runs, with the
    chain of imports that leads to it."""
    modules = module_names(root)
    chains = reachable(import_edges(root), root.name)
    return [
        f"{' -> '.join(chains[name])} imports {stack} (line {line})"
        for name in chains
        if name in modules  # a namespace package (no __init__.py) has no code of its own
        for stack, line in optional_imports(modules[name])
    ]


# --- the package --------------------------------------------------------------------------------


def test_no_import_cycle_among_the_package_modules():
    modules = module_names(PACKAGE)
    edges = import_edges(PACKAGE)
    runtime = [edge for edge in edges if not edge.type_only]
    cycle = find_cycle(edges)  # type-only imports included: no module imports its own user
    assert not cycle, describe(cycle, modules)
    # not vacuous: the walk found the package's modules and their imports
    assert len(modules) > 40 and len(runtime) > 100, (len(modules), len(runtime))
    assert ("weightsync", "weightsync.sender") in {(edge.source, edge.target) for edge in runtime}


def test_the_package_root_imports_no_optional_stack_at_module_level():
    """Statically: no module that `import weightsync` runs imports an optional stack at module
    level (the subprocess test below is the ground truth; this one names the chain)."""
    offenders = optional_stacks_on_import(PACKAGE)
    assert not offenders, "\n".join(offenders)


VLLM_SERVER_STARTERS = {"cli/serve.py", "serving/background.py"}
"""What starts `weightsync serve --engine vllm` (vLLM's own server with the backend): these may
import weightsync.integrations.vllm, in a function (the vllm engine was asked for)."""


def test_no_module_imports_the_integrations():
    """weightsync.integrations.* are imported by the frameworks they plug into, never by weightsync
    (but for the starters of vLLM's server, in a function)."""
    integrations = PACKAGE / "integrations"
    adapters = PACKAGE / "serving"  # an engine's serving adapter runs its engine's backend
    importers = []
    for path in PACKAGE.rglob("*.py"):
        if integrations in path.parents or (adapters in path.parents and path.parent != adapters):
            continue
        if str(path.relative_to(PACKAGE)) in VLLM_SERVER_STARTERS:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not any("integrations" in (getattr(n, "module", "") or "") for n in top), path
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # deferred imports too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(name.startswith("weightsync.integrations") for name in names):
                importers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not importers, importers


def test_importing_weightsync_loads_no_optional_stack():
    """In a fresh interpreter, `import weightsync` leaves none of the optional stacks in sys.modules."""
    code = f"import sys, weightsync; print(sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r})))"
    paths = [str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]  # this checkout's weightsync
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"`import weightsync` loaded {out.stdout.strip()}"


def test_no_import_cycle_among_the_benchmark_modules():
    edges = import_edges(BENCH)
    runtime = [edge for edge in edges if not edge.type_only]
    cycle = find_cycle(edges)
    assert not cycle, describe(cycle, module_names(BENCH))
    assert ("weightsync_bench", "weightsync_bench.runs") in {(edge.source, edge.target) for edge in runtime}


def test_the_package_never_imports_the_benchmarks():
    """weightsync_bench lives outside the package and imports it: no module of weightsync imports
    it back, at module level, in a function or for types."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            if not any(name.split(".")[0] == "weightsync_bench" for name in names):
                continue
            importers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not importers, importers
    assert not (PACKAGE / "bench").exists(), "the benchmarks have one home: benchmarks/weightsync_bench"


def test_importing_weightsync_or_its_command_loads_no_benchmark_module():
    code = "import sys, weightsync, weightsync.cli; print(sorted(m for m in sys.modules if 'weightsync_bench' in m))"
    paths = [str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"`import weightsync.cli` loaded {out.stdout.strip()}"


# --- the checker itself, on a package made for it ------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return package


def test_the_checker_finds_a_cycle_through_relative_and_submodule_imports(tmp_path):
    package = write_package(
        tmp_path,
        {
            "__init__.py": "from pkg.a import A\n",
            "a.py": "from . import b\nA = 1\n",
            "b.py": "try:\n    from .sub import c\nexcept ImportError:\n    c = None\n",
            "sub/__init__.py": "",
            "sub/c.py": "class C:\n    from pkg import a\n\n    def later(self):\n        from pkg import b\n",
        },
    )
    cycle = find_cycle(import_edges(package))
    assert [(edge.source, edge.target) for edge in cycle] == [
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.sub.c"),
        ("pkg.sub.c", "pkg.a"),
    ]
    assert "pkg.b -> pkg.sub.c  (pkg/b.py:2)" in describe(cycle, module_names(package))


def test_the_checker_leaves_out_deferred_and_type_only_imports(tmp_path):
    package = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "import pkg.b\n",
            "b.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.a import A\nelse:\n    import json\n"
                "def late():\n    from pkg import a\n"
            ),
        },
    )
    edges = import_edges(package)
    assert [(edge.source, edge.target, edge.type_only) for edge in edges] == [
        ("pkg.a", "pkg.b", False),
        ("pkg.b", "pkg.a", True),
    ]
    assert find_cycle([edge for edge in edges if not edge.type_only]) == []
    assert find_cycle(edges), "counting the type-only import, it is a cycle"


@pytest.mark.parametrize("statement", ["import fastapi", "from ray import remote", "import uvicorn.config"])
def test_the_checker_names_the_chain_to_an_optional_stack(tmp_path, statement):
    package = write_package(
        tmp_path,
        {
            "__init__.py": "from .a import x\nimport json\n",
            "a.py": "from pkg.sub import b\nx = 1\n",
            "sub/b.py": statement + "\n",  # sub is a namespace package: no __init__.py
            "c.py": "import vllm\n",  # nothing imports it
        },
    )
    stack = statement.split()[1].split(".")[0]
    assert optional_stacks_on_import(package) == [f"pkg -> pkg.a -> pkg.sub.b imports {stack} (line 1)"]
    chains = reachable(import_edges(package), "pkg")
    assert chains["pkg.sub"] == ["pkg", "pkg.a", "pkg.sub.b", "pkg.sub"], "a submodule import runs its package"


# --- layers -------------------------------------------------------------------------------------

LAYERS = (
    ("starters", ("weightsync.cli", "weightsync.demo", "weightsync.cluster", "weightsync.serving.background")),
    ("engine adapters", ("weightsync.serving.hf", "weightsync.serving.vllm", "weightsync.serving.sglang")),
    ("serving", ("weightsync.serving",)),
    ("integrations", ("weightsync.integrations",)),
    ("worker kit", ("weightsync.workers",)),
)
"""From the top down, one folder each (an engine adapter is a folder inside serving/); a module in
none of these is the core (the data path, its wire, its transports, the trainer's client). A
module may import its own layer and those below it, never one above: the worker kit knows no
engine, an engine's backend (integrations/) knows no server, the serving package's shared
control and HTTP face know no engine adapter, and nothing but what starts a server imports one."""


DOORS = ("weightsync", "weightsync.__main__")
"""The package's own doors, above every layer: its root re-exports the public names (lazily for
the optional ones), and `python -m weightsync` runs the command. Importing the root from anywhere
is no edge upward: importing any module runs its parent packages, the root first."""


def layer_of(module: str) -> tuple[int, str]:
    """(height, name) of `module`'s layer: higher layers may import lower ones."""
    if module in DOORS:
        return len(LAYERS) + 1, "doors"
    for height, (name, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return len(LAYERS) - height, name
    return 0, "core"


def test_no_module_imports_a_higher_layer():
    """Type-only imports included: a type names what its module depends on."""
    upward = [
        f"{edge.source} ({layer_of(edge.source)[1]}) -> {edge.target} ({layer_of(edge.target)[1]}), line {edge.line}"
        for edge in import_edges(PACKAGE)
        if layer_of(edge.target)[0] > layer_of(edge.source)[0] and edge.target != "weightsync"
    ]
    assert not upward, "\n".join(upward)
    # not vacuous: every layer has modules, and the adapters do import the layers below them
    heights = {layer_of(name)[0] for name in module_names(PACKAGE)}
    assert heights == set(range(len(LAYERS) + 2)), heights
    edges = {(layer_of(edge.source)[1], layer_of(edge.target)[1]) for edge in import_edges(PACKAGE)}
    assert {
        ("engine adapters", "serving"),
        ("engine adapters", "integrations"),
        ("serving", "worker kit"),
        ("integrations", "worker kit"),
        ("worker kit", "core"),
    } <= edges


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("weightsync.serving.control") < layer_of("weightsync.serving.vllm.server")
    assert layer_of("weightsync.integrations.vllm.worker") < layer_of("weightsync.serving.hf.app")
    assert layer_of("weightsync.sender") == (0, "core")
    assert layer_of("weightsync.client") == (0, "core"), "the trainer's client sits beside the sender"
    assert layer_of("weightsync.workers.start") < layer_of("weightsync.integrations.sglang.worker")
    assert layer_of("weightsync.integrations.vllm.worker") < layer_of("weightsync.serving.control")


def test_the_architecture_page_maps_every_module():
    """docs/architecture.md's module map names every module of the package (by its file name,
    under its folder's line), so the map cannot fall behind the code."""
    page = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = page.index("## Modules")
    block = page[start : page.index("```", page.index("```", start) + 3)]
    words = set(block.replace(",", " ").replace("(", " ").replace(")", " ").replace(":", " ").split())
    missing = []
    for _name, path in module_names(PACKAGE).items():
        if path.suffix != ".py" or path.name == "__init__.py" or path.name.startswith("_"):
            continue
        stem = path.stem
        if not ({stem, f"{stem}.py", f"{stem}/"} & words):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"modules missing from docs/architecture.md's map: {missing}"
