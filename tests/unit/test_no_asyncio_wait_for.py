"""No module of rollbox uses ``asyncio.wait_for``: in Python 3.11 it returns the inner result
when a cancellation of the caller meets the inner task's completion, so the cancel is lost (a
cancelled create went on to finish). ``async with asyncio.timeout(...)`` has no such window.
``asyncio.Condition.wait_for`` (a predicate wait, not a timeout) is another thing and allowed."""
from __future__ import annotations

import ast
from pathlib import Path

import rollbox

ASYNCIO_MODULES = {"asyncio", "asyncio.tasks"}


def wait_for_uses(path: Path) -> list[str]:
    """Where ``path`` uses asyncio's wait_for: ``asyncio.wait_for`` (also under an alias of
    asyncio) or ``from asyncio import wait_for``, as ``name:line``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"asyncio"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name in ASYNCIO_MODULES}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ASYNCIO_MODULES \
                and any(a.name == "wait_for" for a in node.names):
            found.append((node.lineno, f"{path.name}:{node.lineno}"))
        elif isinstance(node, ast.Attribute) and node.attr == "wait_for" \
                and ast.unparse(node.value) in aliases:
            found.append((node.lineno, f"{path.name}:{node.lineno}"))
    return [where for _, where in sorted(found)]


def test_rollbox_never_uses_asyncio_wait_for() -> None:
    src = Path(rollbox.__file__).parent
    found = [f"{path.relative_to(src)}:{use.rsplit(':', 1)[1]}"
             for path in sorted(src.rglob("*.py")) for use in wait_for_uses(path)]
    assert not found, ("asyncio.wait_for loses a cancellation that meets the inner result in "
                       f"3.11: use `async with asyncio.timeout(...)` at {found}")


def test_the_check_sees_each_form(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text("import asyncio\n"
                   "import asyncio as aio\n"
                   "from asyncio import wait_for\n"
                   "from asyncio.tasks import wait_for as wf\n"
                   "async def f(cond, fut):\n"
                   "    await asyncio.wait_for(fut, 1)\n"
                   "    await aio.wait_for(fut, 1)\n"
                   "    g = asyncio.wait_for\n"
                   "    await cond.wait_for(lambda: True)\n")
    assert wait_for_uses(mod) == ["m.py:3", "m.py:4", "m.py:6", "m.py:7", "m.py:8"]
