"""No module of rollbox (nor a benchmark) but ``rollbox.config`` reads a ``ROLLBOX_*``
variable: settings are read in one place, when a Settings is made, and handed to the code that
needs them (a read elsewhere is a setting ``rollbox config`` does not show, and a read at import
time ignores a later change). Caught forms: ``os.environ.get``/``[...]``/``setdefault``/``pop``,
``os.getenv``, ``in os.environ`` (also ``environ`` imported from os), with the name as a
literal, an f-string or a module constant, and typer's ``envvar=``."""
from __future__ import annotations

import ast
from pathlib import Path

import rollbox
from rollbox.config import REPO_ROOT

ENVIRON = {"os.environ", "environ"}
GETTERS = {"os.getenv", "getenv"}
ENVIRON_METHODS = {"get", "setdefault", "pop"}
# The one exception: the SDK's client defaults (ROLLBOX_URL, ROLLBOX_API_KEY) are the client's
# own, read where the SDK runs (often a host without a node); reading them through
# rollbox.config would make the client import the node's settings.
ALLOWED = {"config.py", "sdk/_env.py"}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def _rollbox_name(node: ast.expr | None, consts: dict[str, str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("ROLLBOX_")
    if isinstance(node, ast.Name):
        return consts.get(node.id, "").startswith("ROLLBOX_")
    if isinstance(node, ast.JoinedStr) and node.values:
        return _rollbox_name(node.values[0], consts)
    return False


def env_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read (or set) a ROLLBOX_* variable of this process."""
    tree = ast.parse(path.read_text(), str(path))
    consts = _constants(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            first = node.args[0] if node.args else None
            if (fn in GETTERS or (isinstance(node.func, ast.Attribute)
                                  and node.func.attr in ENVIRON_METHODS
                                  and ast.unparse(node.func.value) in ENVIRON)) \
                    and _rollbox_name(first, consts):
                lines.append(node.lineno)
            if any(k.arg == "envvar" and _rollbox_name(k.value, consts) for k in node.keywords):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ENVIRON \
                and _rollbox_name(node.slice, consts):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and _rollbox_name(node.left, consts) \
                and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                and any(ast.unparse(c) in ENVIRON for c in node.comparators):
            lines.append(node.lineno)
    return sorted(set(lines))


def _reads() -> dict[str, list[int]]:
    """Reads in rollbox's modules (named relative to the package) and in the benchmarks
    (``bench/...``), which give their servers variables in the child's environment instead."""
    src = Path(rollbox.__file__).parent
    paths = [(p, p.relative_to(src).as_posix()) for p in sorted(src.rglob("*.py"))]
    paths += [(p, p.relative_to(REPO_ROOT).as_posix())
              for p in sorted((REPO_ROOT / "bench").rglob("*.py"))]
    return {rel: lines for path, rel in paths
            if rel not in ALLOWED and (lines := env_reads(path))}


def test_only_config_reads_rollbox_variables() -> None:
    found = _reads()
    assert not found, ("read ROLLBOX_* variables in rollbox.config (a setting() of Settings) "
                       f"and hand the value to the code: {found}")


def test_the_check_sees_each_form(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("import os\n"
                   "from os import environ, getenv\n"
                   "import typer\n"
                   "NAME = 'ROLLBOX_X'\n"
                   "a = os.environ.get('ROLLBOX_A', '1')\n"
                   "b = os.environ['ROLLBOX_B']\n"
                   "c = 'ROLLBOX_C' in os.environ\n"
                   "d = os.getenv('ROLLBOX_D')\n"
                   "e = environ.get(NAME)\n"
                   "f = getenv(f'ROLLBOX_{a}')\n"
                   "os.environ.setdefault('ROLLBOX_G', '1')\n"
                   "h = typer.Option(None, envvar='ROLLBOX_H')\n"
                   "os.environ.pop(NAME, None)\n"
                   # not reads of a ROLLBOX_ variable of this process:
                   "i = os.environ.get('HOME')\n"
                   "j = {'ROLLBOX_J': '1'}\n"
                   "k = {**os.environ, 'ROLLBOX_K': '1'}\n"
                   "l = 'ROLLBOX_L' in j\n")
    assert env_reads(mod) == list(range(5, 14))
