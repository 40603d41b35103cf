"""The error tree in ``rollbox.errors``' docstring is the classes' (names, parents, codes, HTTP
statuses, retryable), every error is in the code map the SDK rebuilds errors with, and no
module outside ``rollbox.errors`` defines an error with a wire code of its own."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import rollbox
import rollbox.sdk
from rollbox import errors

SRC = Path(rollbox.__file__).parent
ROW = re.compile(r"^(?P<indent>[ │├└─]*)(?P<name>[A-Za-z]+)\s+(?P<code>[a-z_]+)\s+"
                 r"(?P<status>\d{3}) (?P<retry>[R ])  \S")
# Carried by the SDK with its result (not rebuilt from a payload); travels as bad_request.
NOT_IN_CODE_MAP = {"CommandFailed", "DiskFull"}


def tree_rows() -> list[tuple[str, str | None, str, int, bool]]:
    """(name, parent, code, status, retryable) of each line of the docstring's tree."""
    doc = errors.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    rows: list[tuple[str, str | None, str, int, bool]] = []
    parents: list[str] = []
    for line in block.splitlines():
        m = ROW.match(line.removeprefix("    "))
        assert m, f"not a tree row: {line!r}"
        depth = len(m["indent"]) // 4
        parents[depth:] = [m["name"]]
        parent = parents[depth - 1] if depth else None
        rows.append((m["name"], parent, m["code"], int(m["status"]), m["retry"] == "R"))
    return rows


def error_classes() -> dict[str, type[errors.RollboxError]]:
    return {name: obj for name, obj in vars(errors).items()
            if isinstance(obj, type) and issubclass(obj, errors.RollboxError)
            and obj.__module__ == errors.__name__}


def test_the_docstring_tree_is_the_classes() -> None:
    rows = tree_rows()
    classes = error_classes()
    assert sorted(name for name, *_ in rows) == sorted(classes)
    for name, parent, code, status, retryable in rows:
        cls = classes[name]
        base = cls.__bases__[0]
        assert (base.__name__ if base is not Exception else None) == parent, name
        assert (cls.code, cls.status, cls.retryable) == (code, status, retryable), name


def test_every_error_but_the_sdks_own_is_in_the_code_map() -> None:
    mapped = {cls.__name__ for cls in errors.ERRORS_BY_CODE.values()}
    assert mapped == set(error_classes()) - NOT_IN_CODE_MAP
    assert all(code == cls.code for code, cls in errors.ERRORS_BY_CODE.items())
    for name in NOT_IN_CODE_MAP:
        assert name not in mapped


def test_public_errors_import_from_rollbox_errors() -> None:
    assert rollbox.sdk.CommandFailed is errors.CommandFailed is rollbox.CommandFailed
    from rollbox.netpolicy import mirror

    for name in ("HashMismatch", "UpstreamBadResponse", "UpstreamTooLarge",
                 "UpstreamUnavailable"):
        assert getattr(mirror, name) is getattr(errors, name)


def codes_defined_outside(src: Path) -> list[str]:
    """Classes outside errors.py deriving from a rollbox error that set a ``code``."""
    names = set(error_classes())
    found = []
    for path in sorted(src.rglob("*.py")):
        if path == src / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else b.attr
                     for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}
            sets_code = any(isinstance(stmt, ast.Assign)
                            and any(isinstance(t, ast.Name) and t.id == "code"
                                    for t in stmt.targets)
                            for stmt in node.body)
            if bases & names and sets_code:
                found.append(f"{path.relative_to(src)}: {node.name}")
    return found


def test_no_error_with_a_code_of_its_own_outside_rollbox_errors() -> None:
    assert codes_defined_outside(SRC) == []


def test_the_check_sees_a_code_defined_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("from rollbox import errors\n\n"
                                   "class Mine(errors.InfraError):\n    code = 'mine'\n")
    assert codes_defined_outside(tmp_path) == ["m.py: Mine"]
