"""The built-in PyPI proxy (``rollbox.netpolicy.mirror``) served by this process: under the api
app's lifetime when ``pypi_mirror_enabled`` (a front door with no routes: sandboxes must never
reach the api port, so it listens on its own address), in the foreground for ``rollbox mirror
serve``, or as :func:`running_pypi_mirror` from code and tests. Owns the serving only; the
mirror and its settings are netpolicy's.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from rollbox.api.server import BackgroundServer, serve_app
from rollbox.config import Settings
from rollbox.netpolicy.mirror import pypi_mirror

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rollbox.api.context import ApiContext


@contextlib.asynccontextmanager
async def running_pypi_mirror(settings: Settings | None = None, host: str | None = None,
                              port: int | None = None) -> AsyncIterator[str]:
    """The PyPI proxy served in the current event loop; yields its base URL (port 0 = free)."""
    s = settings or Settings()
    mirror = pypi_mirror(s)
    server = BackgroundServer(mirror.app,  # type: ignore[arg-type] - any ASGI app serves
                              host or s.pypi_mirror_host,
                              s.pypi_mirror_port if port is None else port)
    async with server:
        yield server.url


async def serve(settings: Settings | None = None, host: str | None = None,
                port: int | None = None) -> None:
    """Serve the PyPI proxy in the foreground until SIGINT/SIGTERM (``rollbox mirror serve``)."""
    s = settings or Settings()
    await serve_app(pypi_mirror(s).app,  # type: ignore[arg-type]
                    host or s.pypi_mirror_host, s.pypi_mirror_port if port is None else port)


def mount(app: FastAPI, api: ApiContext) -> contextlib.AbstractAsyncContextManager[None] | None:
    """Front door: no routes on the api app; when ``pypi_mirror_enabled``, the api's lifetime
    runs the proxy on its own address."""
    s = Settings()
    if not s.pypi_mirror_enabled:
        return None

    @contextlib.asynccontextmanager
    async def lifetime() -> AsyncIterator[None]:
        async with running_pypi_mirror(s):
            yield

    return lifetime()
