"""One exception tree: `errors.__all__`, the classes' real hierarchy, the tree drawn in the
docstring of errors.py and the one in docs/errors.md agree, and no module of weightsync defines
an exception class anywhere else."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from weightsync import errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "weightsync"
DOCS = ROOT / "docs" / "errors.md"

LINE = re.compile(r"^(?P<indent>(?:  )*)(?P<name>\w+)(?:\((?P<bases>[\w, ]+)\))?(?:\s+(?P<says>\S.*))?$")


def parse_tree(drawing: str) -> dict[str, tuple[str | None, tuple[str, ...] | None]]:
    """name -> (parent in the drawing, the bases written in parentheses or None), in order."""
    tree: dict[str, tuple[str | None, tuple[str, ...] | None]] = {}
    path: list[str] = []
    for line in drawing.splitlines():
        match = LINE.match(line)
        assert match, f"not a tree line: {line!r}"
        depth = len(match["indent"]) // 2
        assert depth <= len(path), f"indented too far: {line!r}"
        assert depth == 0 or match["says"], f"says nothing about when it is raised: {line!r}"
        path[depth:] = [match["name"]]
        bases = tuple(base.strip() for base in match["bases"].split(",")) if match["bases"] else None
        tree[match["name"]] = (path[depth - 1] if depth else None, bases)
    return tree


def docstring_drawing() -> str:
    """The indented block after `::` in errors.py's module docstring, dedented."""
    block = errors.__doc__.split("::\n\n", 1)[1].split("\n\n", 1)[0]  # type: ignore[union-attr]
    return "\n".join(line.removeprefix("    ") for line in block.splitlines())


def docs_drawing() -> str:
    """The first fenced block of docs/errors.md."""
    return DOCS.read_text().split("```\n", 2)[1].rstrip("\n")


def test_docs_draw_the_docstring_tree_line_for_line():
    assert docs_drawing() == docstring_drawing()


def test_the_tree_is_all_and_the_real_hierarchy():
    tree = parse_tree(docstring_drawing())
    assert sorted(tree) == errors.__all__, "the drawing names exactly the classes in __all__"
    assert errors.__all__ == sorted(errors.__all__)
    assert [name for name, (parent, _) in tree.items() if parent is None] == ["WeightSyncError"]
    for name, (parent, bases) in tree.items():
        cls = getattr(errors, name)
        ours = [base.__name__ for base in cls.__bases__ if base.__name__ in tree]
        assert ours == ([parent] if parent else []), f"{name} derives from {ours}, drawn under {parent}"
        foreign = [base.__name__ for base in cls.__bases__ if base.__name__ not in tree]
        if bases is None:
            assert foreign == ([] if parent else ["Exception"]), f"{name} has bases {foreign} the drawing omits"
        else:
            assert list(bases) == [base.__name__ for base in cls.__bases__], f"{name}: drawn {bases}"


def test_every_class_in_the_module_is_in_all():
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)


def test_the_docs_table_names_only_classes_of_the_tree():
    rows = re.findall(r"^\| `(\w+)`", DOCS.read_text(), flags=re.MULTILINE)
    assert rows and set(rows) <= set(errors.__all__)


def exception_classes(source: Path) -> dict[str, list[str]]:
    """Every class defined anywhere in `source` that derives from an exception, found by reading
    the code (importing every module would pull in vLLM, Ray and the server stack): name ->
    the files that define it."""
    bases: dict[str, set[str]] = {}
    where: dict[str, list[str]] = {}
    for path in sorted(source.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
                where.setdefault(node.name, []).append(str(path.relative_to(source)))
    builtin = {name for name, value in vars(builtins).items() if isinstance(value, type)}
    found = {name for name in builtin if issubclass(getattr(builtins, name), BaseException)}
    grew = True
    while grew:
        new = {name for name, of in bases.items() if of & found} - found
        found |= new
        grew = bool(new)
    return {name: where[name] for name in found if name in where}


def test_every_exception_class_of_weightsync_is_defined_in_errors_py():
    found = exception_classes(PACKAGE)
    assert set(found) == set(errors.__all__)
    elsewhere = {name: files for name, files in found.items() if files != ["errors.py"]}
    assert not elsewhere, f"exception classes defined outside errors.py: {elsewhere}"


def test_every_error_survives_pickling():
    """Ray and multiprocessing carry errors back to the caller (verl's trainer sees a worker's
    SyncFailed): each class must unpickle as itself, with its message and attributes."""
    import pickle

    from weightsync.report import ReceiverOutcome, SyncReport

    report = SyncReport(1, 64, 1, 1, 64, 0.1, (ReceiverOutcome("shm://@a", False, "PeerClosedError", "gone"),))
    special = {
        errors.SyncFailed: errors.SyncFailed("shm://@a: PeerClosedError: gone", report),
        errors.ServerError: errors.ServerError(503, {"error": {"message": "syncing"}}),
        errors.RemoteError: errors.RemoteError("refused", kind="PlanError"),
    }
    for name in errors.__all__:
        cls = getattr(errors, name)
        if cls in special:
            error = special[cls]
        elif issubclass(cls, errors.TransportError):
            error = cls("stalled", transport="shm", version=3, bucket=1)
        else:
            error = cls("bad")
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls and str(back) == str(error) and vars(back) == vars(error), name


def test_a_transport_error_is_told_where_it_happened_by_the_loop_it_passes():
    """The raiser says what it knows; the sync loop fills in the rest and never overrides it."""
    error = errors.PeerClosedError("gone", transport="tcp")
    assert str(error) == "gone (transport=tcp)"
    assert error.at(version=4, bucket=0) is error
    assert str(error) == "gone (transport=tcp, version=4, bucket=0)"
    raised_knowing = errors.ChecksumError("bad bytes", version=2, bucket=5).at(version=9, bucket=1)
    assert (raised_knowing.version, raised_knowing.bucket) == (2, 5)
    assert str(errors.ProtocolError("odd").at(version=1)) == "odd (version=1)"
