"""The PyPI mirror with real pip against the real PyPI: download and install through it, then
the same again from its cache alone with the upstream unreachable."""
from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
import sys
from pathlib import Path

import httpx
import pytest

from rollbox.config import Settings
from rollbox.api.mirror import running_pypi_mirror

PINNED = ["six==1.16.0", "iniconfig==2.0.0"]


@pytest.fixture(scope="module")
def real_pypi() -> None:
    try:
        with httpx.Client(verify=ssl.create_default_context(), trust_env=False,
                          timeout=10) as c:
            c.get("https://pypi.org/simple/six/").raise_for_status()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"PyPI unreachable from this machine: {exc!r}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once closed


def mirror_settings(data: Path, upstream: str | None = None) -> Settings:
    s = Settings()
    s.data_dir = data
    if upstream is not None:
        s.pypi_mirror_index_upstream = f"{upstream}/simple/"
        s.pypi_mirror_file_upstreams = (upstream,)
        s.pypi_mirror_index_ttl = 0  # every request tries the (dead) upstream first
    return s


async def pip(index: str, *args: str) -> tuple[int, str]:
    """pip with none of this machine's pip config: the mirror is its only source."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PIP_CONFIG_FILE": os.devnull,
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": "/nonexistent"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pip", "--isolated", *args, "--index-url", f"{index}/simple/",
        "--no-cache-dir", "--timeout", "20", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode or 0, out.decode(errors="replace")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_pip_through_mirror_then_from_cache_with_upstream_down(
        real_pypi: None, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first, second, target = tmp_path / "d1", tmp_path / "d2", tmp_path / "site"

    async with running_pypi_mirror(mirror_settings(data), port=0) as url:
        rc, out = await pip(url, "download", "--no-deps", "-d", str(first), *PINNED)
        assert rc == 0, out
        assert f"{url}/files/six/" in out  # fetched through the mirror, not elsewhere
        async with httpx.AsyncClient() as c:
            page = (await c.get(f"{url}/simple/six/", headers={
                "Accept": "application/vnd.pypi.simple.v1+json"})).json()
    wheels = {p.name: sha256(p) for p in first.iterdir()}
    assert set(wheels) == {"six-1.16.0-py2.py3-none-any.whl", "iniconfig-2.0.0-py3-none-any.whl"}
    listed = {f["filename"]: f["hashes"]["sha256"] for f in page["files"]}
    assert wheels["six-1.16.0-py2.py3-none-any.whl"] == listed["six-1.16.0-py2.py3-none-any.whl"]
    for digest in wheels.values():  # kept content-addressed
        assert (data / "mirror" / "pypi" / "blobs" / digest[:2] / digest).is_file()

    dead = f"http://127.0.0.1:{closed_port()}"
    async with running_pypi_mirror(mirror_settings(data, dead), port=0) as url:
        rc, out = await pip(url, "download", "--no-deps", "-d", str(second), *PINNED)
        assert rc == 0, out
        assert {p.name: sha256(p) for p in second.iterdir()} == wheels
        rc, out = await pip(url, "install", "--no-deps", "--target", str(target), *PINNED)
        assert rc == 0, out
        assert (target / "six.py").is_file() and (target / "iniconfig").is_dir()
        # Not cached, upstream down: a retryable error, not a hang or a 404.
        async with httpx.AsyncClient() as c:
            r = await c.get(f"{url}/simple/requests/")
        assert r.status_code == 503
        assert r.json()["error"]["retryable"] is True
