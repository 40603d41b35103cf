"""Mirror settings from the environment, the Debian sources file, and the api front
door that runs the PyPI mirror on its own port only when enabled."""
from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from rollbox.api import mirror as mirror_door
from rollbox.config import Settings
from rollbox.netpolicy import mirror


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBOX_MIRRORS", "npm=http://10.9.0.1:4873/, go=http://10.9.0.1:3000,bad")
    monkeypatch.setenv("ROLLBOX_PYPI_FILE_UPSTREAMS", "https://a.example, https://b.example")
    monkeypatch.delenv("ROLLBOX_PYPI_MIRROR", raising=False)
    s = Settings()
    assert s.mirrors == {"npm": "http://10.9.0.1:4873/", "go": "http://10.9.0.1:3000"}
    assert s.pypi_mirror_file_upstreams == ("https://a.example", "https://b.example")
    assert s.mirror_url("pypi") is None  # no mirror: netpolicy must not open anything
    monkeypatch.setenv("ROLLBOX_PYPI_MIRROR", "1")
    monkeypatch.setenv("ROLLBOX_PYPI_MIRROR_HOST", "10.9.0.1")
    s = Settings()
    assert s.mirror_url("pypi") == "http://10.9.0.1:3141/simple/"
    assert "URIs: http://10.9.0.1:3142/debian\n" in mirror.debian_sources("http://10.9.0.1:3142/")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_front_door_runs_mirror_on_its_own_port(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLBOX_DATA", str(tmp_path))
    monkeypatch.delenv("ROLLBOX_PYPI_MIRROR", raising=False)
    assert mirror_door.mount(None, None) is None  # off by default: nothing listens
    port = free_port()
    monkeypatch.setenv("ROLLBOX_PYPI_MIRROR", "1")
    monkeypatch.setenv("ROLLBOX_PYPI_MIRROR_PORT", str(port))
    ctx = mirror_door.mount(None, None)
    assert ctx is not None
    async with ctx, httpx.AsyncClient() as c:
        r = await c.get(f"http://127.0.0.1:{port}/health")
        assert r.status_code == 200 and r.json()["ok"] is True
    assert (tmp_path / "mirror" / "pypi" / "blobs").is_dir()
    with pytest.raises(httpx.ConnectError):  # stopped with the api
        async with httpx.AsyncClient() as c:
            await c.get(f"http://127.0.0.1:{port}/health")
