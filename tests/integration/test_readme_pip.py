"""The README's "What a trainer gets" example on python:3.11: with network=["pypi"],
`pip install -e .` of a small repository (pyproject, setuptools backend, one dependency) works
through the platform's PyPI mirror — build isolation fetches setuptools from it too — and the
package imports from anywhere afterwards. Needs PyPI reachable from the host (the mirror's
upstream)."""
from __future__ import annotations

import pytest

from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from tests.conftest import needs_python
from tests.integration.test_netpolicy_pypi import pypi_mirror

pytestmark = [needs_python, pytest.mark.slow]

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "demo-pkg"
version = "0.1.0"
dependencies = ["six==1.16.0"]
"""


@pytest.mark.parametrize("layout", ["src", "flat"])
async def test_readme_pip_install_editable(edge, layout: str) -> None:  # noqa: ANN001
    """src: setuptools writes its egg-info under src/; flat: in /work/repo itself, a parent of
    the hidden /work/repo/tests, created and read back in one command."""
    async with pypi_mirror(edge):
        # As in the README: the task's tests are hidden (Landlock rules around /work/repo).
        sid = (await edge.create(SandboxSpec(image="python:3.11", hidden_paths=[
            "/work/repo/tests"], network=NetworkPolicy(allow=["pypi"])))).id
        pkg = "/work/repo/src/demo_pkg" if layout == "src" else "/work/repo/demo_pkg"
        await edge.file_mkdir(sid, pkg, True)
        await edge.file_mkdir(sid, "/work/repo/tests", True)
        await edge.file_write(sid, "/work/repo/tests/test_x.py", b"def test(): pass\n", 0o644)
        await edge.file_write(sid, "/work/repo/pyproject.toml", PYPROJECT.encode(), 0o644)
        await edge.file_write(sid, f"{pkg}/__init__.py", b"import six\nVALUE = 42\n", 0o644)
        eid = await edge.exec_start(sid, ExecSpec(cmd="pip install -e .", cwd="/work/repo",
                                                  timeout_s=300))
        r = await edge.exec_wait(sid, eid)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "Successfully installed" in r.stdout and "demo-pkg" in r.stdout, r
        eid = await edge.exec_start(sid, ExecSpec(
            cmd="python -c 'import demo_pkg, six; print(demo_pkg.VALUE, demo_pkg.__file__)'",
            cwd="/tmp"))
        r = await edge.exec_wait(sid, eid)
        assert r.exit_code == 0 and r.stdout.startswith(f"42 {pkg}/"), r
