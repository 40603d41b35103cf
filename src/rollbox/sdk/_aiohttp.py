"""The SDK's HTTP transport on aiohttp (about a sixth of httpx's client CPU per request), and its
blocking twin on ``http.client`` for job heartbeats. Owns connections, timeouts and how their
failures read (``ServerUnreachable`` / ``ConnectionLost``); nothing above the bytes.
"""
from __future__ import annotations

import asyncio
import http.client
import urllib.parse
from collections.abc import AsyncIterator

import aiohttp

from rollbox import errors
from rollbox.sdk._transport import Request

# What a broken connection, refused connect or socket timeout looks like in aiohttp.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def _transport_error(what: str, exc: BaseException) -> errors.InfraError:
    """A refused/failed or timed-out connect (or wait for a pooled connection) never reached
    the server; anything later may have."""
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return errors.ServerUnreachable(f"{what}: {exc!r}")
    return errors.ConnectionLost(f"{what}: {exc!r}")


class AiohttpResponse:
    """An open answer; ``aclose`` it."""

    def __init__(self, resp: aiohttp.ClientResponse, what: str) -> None:
        self.resp = resp
        self.status = resp.status
        self._what = what

    async def read(self) -> bytes:
        try:
            return await self.resp.read()
        except _TRANSPORT_ERRORS as exc:
            raise _transport_error(self._what, exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.content.iter_any():
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise errors.ConnectionLost(f"stream broken: {exc!r}") from exc

    async def aclose(self) -> None:
        # Fully read: the connection goes back to the pool; else it is closed (never reused
        # with half a body on it).
        if self.resp.content.at_eof():
            self.resp.release()
        else:
            self.resp.close()


class AiohttpTransport:
    """HTTP to a rollbox server. ``timeout``: each phase (pool wait, connect, every read) of a
    request at most that long, as ``httpx.Timeout(t)``; streams and waits have no read timeout
    (a command may stay silent as long as it runs). At most ``max_connections`` open. The
    session is made on first use, inside the running loop, so a transport (and its client) can
    be constructed outside one."""

    def __init__(self, base_url: str, *, timeout: float = 60.0,
                 max_connections: int = 1024) -> None:
        self.base_url = base_url
        self._root = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout = aiohttp.ClientTimeout(total=None, connect=timeout,
                                             sock_connect=timeout, sock_read=timeout)
        # Streams and waits may also wait for a pooled connection behind others.
        self.stream_timeout = aiohttp.ClientTimeout(total=None, connect=None,
                                                    sock_connect=timeout, sock_read=None)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._closed:  # as httpx did: a closed client stays closed
                raise RuntimeError("the rollbox client has been closed")
            # Plain http never touches TLS: aiohttp uses its (import-time) SSL context only
            # for https URLs, so making a session costs no CA-bundle load.
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
            )
        return self._session

    async def handle(self, request: Request) -> AiohttpResponse:
        what = f"{request.method} {request.target}"
        try:
            resp = await self._http().request(
                request.method, self._root + request.target, params=request.params,
                data=request.body, headers=request.headers,
                timeout=self.stream_timeout if request.long else self.timeout,
                allow_redirects=False)
        except _TRANSPORT_ERRORS as exc:
            raise _transport_error(what, exc) from exc
        return AiohttpResponse(resp, what)

    def blocking(self, timeout_s: float) -> HttpClientTransport:
        return HttpClientTransport(self.base_url, timeout_s)

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class HttpClientTransport:
    """Blocking requests on one kept-alive ``http.client`` connection (made again after a
    failure), for a thread of its own."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        url = urllib.parse.urlsplit(base_url)
        self._https = url.scheme == "https"
        self._host = url.netloc
        self._prefix = url.path.rstrip("/")
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def handle(self, request: Request) -> tuple[int, bytes]:
        if request.params or not (request.body is None or isinstance(request.body, bytes)):
            raise ValueError("blocking requests take a target with its query and a bytes body")
        what = f"{request.method} {request.target}"
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, timeout=self.timeout_s)
            try:
                self._conn.connect()
            except OSError as exc:  # refused, unreachable, timed out: never sent
                self.close()
                raise errors.ServerUnreachable(f"{what}: {exc!r}") from exc
        try:
            self._conn.request(request.method, self._prefix + request.target, body=request.body,
                               headers=request.headers or {})
            resp = self._conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise errors.ConnectionLost(f"{what}: {exc!r}") from exc

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()
