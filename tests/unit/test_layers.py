"""The layer order of rollbox holds: import-linter checks the contract of pyproject.toml
(``[tool.importlinter]``) on this tree's ``src/rollbox``: no module imports a layer above its own
(at module level, inside functions or under TYPE_CHECKING alike), and every module directly
under rollbox is in a layer. docs/architecture.md's picture of the layers is what
``tools/layers.py`` draws from the contract and the imports now."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import rollbox

SRC = Path(rollbox.__file__).parent.parent  # the tree under test (a worktree's, not the venv's)
PYPROJECT = SRC.parent / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"  # requirements.lock: import-linter


def lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    """The linter on the rollbox under ``src``: the venv's editable install points elsewhere, so
    ``src`` goes first on the path; no cache is written into the tree."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(PYPROJECT)], cwd=src, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_layer_contract_is_kept() -> None:
    res = lint_imports(SRC)
    assert res.returncode == 0, f"the layer contract is broken:\n{res.stdout}\n{res.stderr}"


def copy_of_rollbox(dest: Path) -> Path:
    shutil.copytree(SRC / "rollbox", dest / "rollbox",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    src = copy_of_rollbox(tmp_path)
    with (src / "rollbox" / "hostfs.py").open("a") as f:
        f.write("\n\ndef _probe() -> None:\n    from rollbox.edge import storage  # noqa: F401\n")
    res = lint_imports(src)
    assert res.returncode != 0
    assert "rollbox.hostfs is not allowed to import rollbox.edge" in res.stdout, res.stdout
    assert "rollbox.hostfs -> rollbox.edge.storage" in res.stdout


def test_the_check_sees_a_module_in_no_layer(tmp_path: Path) -> None:
    src = copy_of_rollbox(tmp_path)
    (src / "rollbox" / "unlayered.py").write_text('"""In no layer of the contract."""\n')
    res = lint_imports(src)
    assert res.returncode != 0
    assert "rollbox.unlayered" in res.stdout, res.stdout


def layers_tool() -> ModuleType:
    path = SRC.parent / "tools" / "layers.py"
    spec = importlib.util.spec_from_file_location("rollbox_tools_layers", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_architecture_doc_draws_the_layers_of_the_code() -> None:
    tool = layers_tool()
    doc = tool.DOC.read_text()
    assert tool.with_block(doc, tool.render(SRC, PYPROJECT)) == doc, (
        "docs/architecture.md's layers picture is stale: python tools/layers.py")


def test_the_picture_leaves_out_arrows_a_longer_path_implies() -> None:
    tool = layers_tool()
    edges = {"api": {"edge", "backends", "errors"}, "edge": {"backends"},
             "backends": {"errors"}, "errors": set()}
    assert tool.without_implied(edges) == {"api": {"edge"}, "edge": {"backends"},
                                           "backends": {"errors"}, "errors": set()}
    text = tool.mermaid([["api"], ["edge"], ["backends"], ["errors"]], tool.without_implied(edges))
    assert "p_api --> p_edge" in text and "p_api --> p_backends" not in text


def strings_of(path: Path) -> list[str]:
    """Every string literal of a module (docstrings and f-string parts too)."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_the_api_names_no_compat_module() -> None:
    """The front doors above the api are passed to create_app, never named for importlib (an
    upward import the linter can not see)."""
    named = {f"{path.relative_to(SRC)}: {s!r}"
             for path in sorted((SRC / "rollbox" / "api").rglob("*.py"))
             for s in strings_of(path) if re.search(r"\brollbox\.compat\b", s)}
    assert not named, f"rollbox.api names rollbox.compat modules: {sorted(named)}"


def test_importing_the_api_app_loads_no_compat_module() -> None:
    probe = ("import sys, rollbox.api.app\n"
             "print(sorted(m for m in sys.modules\n"
             "             if m == 'rollbox.compat' or m.startswith('rollbox.compat.')))\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"importing rollbox.api.app loaded {res.stdout.strip()}"
