"""``network=["pypi"]`` end to end: the built-in PyPI mirror on a free port, a real python:3.11
sandbox installs a pinned package through it, and nothing else (the public index, its file
host, a raw IP) is reachable from the same sandbox."""
from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from rollbox.config import Settings
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from rollbox.netpolicy import link
from rollbox.api.mirror import running_pypi_mirror
from tests.conftest import needs_python

pytestmark = [needs_python]

FETCH = """
import sys, urllib.request
for url in sys.argv[1:]:
    try:
        urllib.request.urlopen(url, timeout=5).read(10); print(url, 'FETCHED')
    except Exception as e:
        print(url, 'failed', type(e).__name__)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pypi_reachable() -> bool:
    try:
        return httpx.get("https://pypi.org/simple/six/", timeout=10,
                         headers={"Accept": "application/vnd.pypi.simple.v1+json"}).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.asynccontextmanager
async def pypi_mirror(edge) -> AsyncIterator[Settings]:  # noqa: ANN001
    """The edge's settings with the built-in PyPI mirror running on a free loopback port."""
    if not pypi_reachable():
        pytest.skip("PyPI is not reachable from this host (the mirror has no upstream)")
    s = edge.settings
    s.mirrors = {}
    s.pypi_mirror_enabled, s.pypi_mirror_host, s.pypi_mirror_port = True, "127.0.0.1", free_port()
    async with running_pypi_mirror(s):
        yield s


async def test_pip_install_through_mirror_only(edge) -> None:
    async with pypi_mirror(edge) as s:
        sid = (await edge.create(SandboxSpec(image="python:3.11",
                                             network=NetworkPolicy(allow=["pypi"])))).id
        gate = link.find(sid).gate_ip  # type: ignore[union-attr]

        async def sh(cmd: str, timeout: float = 120):
            eid = await edge.exec_start(sid, ExecSpec(cmd=["sh", "-c", cmd], timeout_s=timeout))
            return await edge.exec_wait(sid, eid)

        r = await sh("echo $PIP_INDEX_URL; python3 -m pip install --break-system-packages "
                     "--no-cache-dir --force-reinstall --no-deps six==1.16.0 2>&1 | tail -3; "
                     "python3 -c 'import six; print(six.__version__, six.__file__)'")
        lines = r.stdout.splitlines()
        assert lines[0] == f"http://{gate}:{s.pypi_mirror_port}/simple/", r
        assert "Successfully installed six-1.16.0" in r.stdout, r
        assert lines[-1].startswith("1.16.0 "), r
        # Everything else from the same sandbox fails: names are refused, IPs closed.
        r = await sh(f"python3 -c \"{FETCH}\" https://files.pythonhosted.org/ "
                     "https://pypi.org/simple/six/ https://151.101.0.223/ "
                     f"http://{gate}:7420/ http://{gate}:{s.pypi_mirror_port + 1}/")
        assert r.stdout.count("failed") == 5 and "FETCHED" not in r.stdout, r
        # The mirror port is open at the gate only.
        r = await sh(f"python3 -c \"{FETCH}\" http://{gate}:{s.pypi_mirror_port}/health")
        assert "FETCHED" in r.stdout, r
