"""``rollbox.images`` sits below the backends and the edge and has no import cycle inside: no
module of it imports a higher layer, and its modules' imports (module level and inside
functions alike, not ``TYPE_CHECKING`` ones) form no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import rollbox.images

SRC = Path(rollbox.images.__file__).parent.parent.parent
# Layers above images (rollbox's own order: models/errors/config < isolation, events, images,
# netpolicy < backends < edge < placement, iam, fncall < api < compat, sdk, cli) and the tools
# on top.
ABOVE = ("rollbox.backends", "rollbox.edge", "rollbox.fncall", "rollbox.placement", "rollbox.iam",
         "rollbox.api", "rollbox.compat", "rollbox.sdk", "rollbox.cli", "rollbox.operator_cli",
         "rollbox.image_cli", "rollbox.default_images", "rollbox.browser", "rollbox.demo",
         "rollbox.embedded")  # and "rollbox" itself: the SDK's Client


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """Modules of rollbox that ``path`` imports (``from pkg import mod`` names the module)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                found.add(full if full in known else node.module)
    return {m for m in found if m == "rollbox" or m.startswith("rollbox.")}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in sorted((SRC / "rollbox" / "images").rglob("*.py"))}
    known = set(paths)
    return {mod: imports(path, known) for mod, path in paths.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle among the keys of ``edges`` (empty if none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str]:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(edges.get(mod, ())):
            if dep not in edges or dep == mod:
                continue
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[mod] = 2
        return []

    for mod in sorted(edges):
        if mod not in state and (found := visit(mod)):
            return found
    return []


def test_images_import_no_higher_layer() -> None:
    bad = sorted(f"{mod} -> {dep}" for mod, deps in graph().items() for dep in deps
                 if dep == "rollbox" or dep.startswith(ABOVE))
    assert not bad, f"rollbox.images imports layers above it: {bad}"


def test_images_have_no_import_cycle() -> None:
    found = cycle(graph())
    assert not found, f"import cycle in rollbox.images: {' -> '.join(found)}"


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from rollbox.backends.container.sandbox import X\n"
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from rollbox.edge.edge import Edge\n")
    assert imports(mod, set()) == {"rollbox.backends.container.sandbox"}
