"""The edge speaks to sandboxes only through the backend contract: no module of
``rollbox.edge`` imports a backend's internals (``rollbox.backends.<kind>.*``); what both need
(the safe-tar code of ``rollbox.hostfs``) lives below both."""
from __future__ import annotations

import ast
from pathlib import Path

import rollbox.edge

# Modules of rollbox.backends that are the seam itself, not a backend's internals.
SEAM = {"rollbox.backends", "rollbox.backends.base", "rollbox.backends.registry",
        "rollbox.backends.platform_work",
        "rollbox.backends.ports"}  # the port paths every backend shares, and the relays' end


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # "from rollbox.backends import container" imports a backend package too
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if node.module == "rollbox.backends"}
    return found


def test_the_edge_imports_no_backend_internals() -> None:
    edge_dir = Path(rollbox.edge.__file__).parent
    bad = {f"{path.name}: {mod}"
           for path in sorted(edge_dir.glob("*.py"))
           for mod in imported_modules(path)
           if mod.startswith("rollbox.backends") and mod not in SEAM}
    assert not bad, f"the edge imports backend internals: {sorted(bad)}"


def test_the_check_sees_a_backend_import(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("from rollbox.backends.container.files import SandboxFS\n"
                   "from rollbox.backends import microvm\n")
    assert {"rollbox.backends.container.files",
            "rollbox.backends.microvm"} <= imported_modules(mod)
