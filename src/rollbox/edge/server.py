"""Serving an ASGI app under uvicorn, in the foreground or as a background task: the api
(``rollbox.api`` re-exports these), the PyPI mirror and the edge's HTTP service
(``edge.service``). Owns the uvicorn settings and the start/stop of one server, and the wait
for a server in another process to answer its health check; nothing of any app. One layer below
the api so the edge's service can use it too."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp

from rollbox.errors import InfraError

log = logging.getLogger(__name__)

# Every exec stream and event follower holds a connection for its lifetime.
LIMIT_CONCURRENCY = 65536


class _Server(uvicorn.Server):
    """uvicorn that treats SIGINT/SIGTERM as "shut down gracefully" and then returns.

    Stock uvicorn re-raises the captured signal once it has stopped, which kills the process
    before the caller's own clean-up (the embedded edge's ``stop()``) can run. With
    ``handle_signals=False`` (tests, background servers) the host process keeps its handlers.
    """

    def __init__(self, config: uvicorn.Config, handle_signals: bool) -> None:
        super().__init__(config)
        self.handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.handle_signals:
            yield
            return
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)


def _config(app: ASGIApp, host: str, port: int, uds: str | Path | None,
            access_log: bool) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=str(uds) if uds is not None else None,
        http="httptools",
        # WebSocket upgrades (the port proxy's, rollbox.api.ports; the edge's port channel)
        ws="websockets-sansio",
        loop="asyncio",  # the caller picks the loop (uvloop under `rollbox serve`)
        lifespan="on",
        access_log=access_log,
        log_level="warning",
        limit_concurrency=LIMIT_CONCURRENCY,
        backlog=4096,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    )


async def serve_app(app: ASGIApp, host: str = "127.0.0.1", port: int = 7420, *,
                    uds: str | Path | None = None, access_log: bool = False) -> None:
    """Serve until cancelled (or SIGINT/SIGTERM when run in the main thread)."""
    await _Server(_config(app, host, port, uds, access_log), handle_signals=True).serve()


class BackgroundServer:
    """``async with BackgroundServer(app) as srv: srv.url`` - uvicorn in a task of the
    current loop; port 0 picks a free port. Stops (and waits) on exit."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        # The host process (tests, embedded mode) owns signal handling, not uvicorn.
        self.server = _Server(_config(app, host, port, None, False), handle_signals=False)
        self.host = host
        self.port = port
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # surfaces the bind error
                raise RuntimeError("uvicorn exited before starting")
            await asyncio.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self.url

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            async with asyncio.timeout(10):
                await asyncio.shield(self._task)
        except TimeoutError:
            self.server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None

    async def __aenter__(self) -> BackgroundServer:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()


def wait_healthy(url: str, alive: Callable[[], bool] | None = None, log_file: Path | None = None,
                 timeout: float = 60, what: str = "server") -> None:
    """Until ``url``'s ``/v1/health`` answers 200. InfraError, with the tail of ``log_file``, as
    soon as ``alive()`` says the process serving it exited; InfraError after ``timeout`` s."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            err = log_file.read_text(errors="replace") if log_file and log_file.exists() else ""
            raise InfraError(f"{what} exited: {err[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise InfraError(f"{what} at {url} not healthy after {timeout}s")
