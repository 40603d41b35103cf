"""rollbox's stand-in for SWE-ReX's ``tests/conftest.py`` (copied over it by
``tests/upstream/suites.py``): the same fixture names, pointed at a rollbox sandbox's SWE-ReX
front door instead of SWE-ReX's own server started in a thread.

Owns only these fixtures. What the upstream conftest assumed and this one provides instead:

- ``remote_server``: ``url`` (``{ROLLBOX_URL}/swerex/{sandbox}``), ``port`` (rollbox's) and
  ``headers`` (the rollbox API key as ``X-API-Key``); ``TEST_API_KEY`` is that key.
- ``remote_runtime``: SWE-ReX's unmodified ``RemoteRuntime(host=url, auth_token=key)``.
- ``tmp_path``: SWE-ReX's server ran in the test's own process, so a test wrote a file with
  ``pathlib`` and read it through the runtime (or the reverse). Here the runtime's files are
  the sandbox's: the fixture is pytest's own ``tmp_path`` whose ``write_text``/``mkdir`` also
  write the same path into the sandbox (through rollbox's file API) and whose ``read_text``
  reads the sandbox's file. Uploads read the host's copy, as before.
"""
from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import pytest

import rollbox
from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, Command, CreateBashSessionRequest
from swerex.runtime.remote import RemoteRuntime

URL = os.environ["ROLLBOX_URL"].rstrip("/")
TEST_API_KEY = os.environ["ROLLBOX_API_KEY"]
SANDBOX = os.environ["UPSTREAM_SANDBOX"]
HOST = f"{URL}/swerex/{SANDBOX}"


@dataclass
class RemoteServer:
    port: int
    url: str = HOST
    headers: dict[str, str] = field(default_factory=lambda: {"X-API-Key": TEST_API_KEY})


@pytest.fixture(scope="session")
def remote_server() -> RemoteServer:
    return RemoteServer(int(URL.rsplit(":", 1)[1].split("/")[0]))


@pytest.fixture
async def remote_runtime(remote_server: RemoteServer):
    r = RemoteRuntime(host=remote_server.url, auth_token=TEST_API_KEY)
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: RemoteRuntime):
    await remote_runtime.create_session(CreateBashSessionRequest())
    try:
        yield remote_runtime
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5


@pytest.fixture(scope="session")
def _sandbox() -> Any:
    with rollbox.Client(URL, TEST_API_KEY) as client:
        yield client.get(SANDBOX)


class _SandboxMirrored(pathlib.PosixPath):
    """A host path whose writes are mirrored into the sandbox and whose reads are the
    sandbox's (see the module docstring)."""
    sandbox: Any = None

    def write_text(self, data: str, *args: Any, **kw: Any) -> int:  # type: ignore[override]
        n = super().write_text(data, *args, **kw)
        self.sandbox.files.write(str(self), data.encode())
        return n

    def read_text(self, *args: Any, **kw: Any) -> str:  # type: ignore[override]
        return self.sandbox.files.read_text(str(self))

    def mkdir(self, *args: Any, **kw: Any) -> None:  # type: ignore[override]
        super().mkdir(*args, **kw)
        self.sandbox.exec(["mkdir", "-p", str(self)], check=True)


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
             _sandbox: Any) -> pathlib.Path:
    cls = type("SandboxMirrored", (_SandboxMirrored,), {"sandbox": _sandbox})
    host = tmp_path_factory.mktemp(request.node.name[:30], numbered=True)
    _sandbox.exec(["mkdir", "-p", str(host)], check=True)
    return cls(host)
