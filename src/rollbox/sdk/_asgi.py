"""The SDK's in-process transport: requests call an ASGI app (``rollbox.api.create_app(...)``)
directly, without a server or a socket, so tests of the SDK need no port and no uvicorn.

Unlike httpx's ASGITransport, answers stream: the app runs as a task of its own and the client
reads its body as the app sends it (exec output, event follows), with backpressure. A client
that closes an answer early is a disconnect to the app, as over HTTP. It behaves as uvicorn
does where that shows: an app that fails before answering gives a plain-text 500, one that
fails mid-answer a broken stream (``ConnectionLost``); the app's lifespan (start-up, shutdown)
runs around the transport's use unless someone else runs it. Imports nothing of the api: the
app is given. Owns the calls it runs and nothing else.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import urllib.parse
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from rollbox import errors
from rollbox.sdk._transport import Request

log = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

HOST = "in-process"
# What uvicorn's HTTP protocols announce (the app then listens for disconnects while it
# streams, as under `rollbox serve`).
ASGI = {"version": "3.0", "spec_version": "2.3"}
BODY_DEPTH = 16  # answer chunks buffered between the app and a slow reader
_PATH_SAFE = "/%:@!$&'()*+,;=~"
_QUERY_SAFE = _PATH_SAFE + "?"
GRACE_S = 5.0  # what uvicorn gives requests still running at shutdown (timeout_graceful_shutdown)


class Lifespan:
    """An ASGI app's lifespan (``async with Lifespan(app) as state``): start-up on enter,
    shutdown on exit, as a server runs them; ``state`` is the lifespan state requests get a
    copy of."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._startup: asyncio.Future[None] | None = None
        self._shutdown: asyncio.Future[None] | None = None

    async def __aenter__(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self._startup, self._shutdown = loop.create_future(), loop.create_future()
        startup, shutdown = self._startup, self._shutdown
        sent_startup = False
        spoke = False  # the app sent a lifespan message

        async def receive() -> Message:
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await self._stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(msg: Message) -> None:
            nonlocal spoke
            spoke = True
            kind = msg["type"]
            step = startup if kind.startswith("lifespan.startup.") else shutdown
            if step.done():
                return
            if kind.endswith(".complete"):
                step.set_result(None)
            else:
                step.set_exception(RuntimeError(f"ASGI {kind}: {msg.get('message', '')}"))

        def settle(failure: RuntimeError | None) -> None:
            for step in (startup, shutdown):
                if not step.done():
                    if failure is None:
                        step.set_result(None)
                    else:
                        step.set_exception(failure)

        async def run() -> None:
            try:
                await self.app({"type": "lifespan", "asgi": ASGI, "state": self.state},
                               receive, send)
            except BaseException as exc:
                if spoke:
                    settle(RuntimeError(f"ASGI lifespan failed: {exc!r}"))
                else:  # as uvicorn's lifespan "auto": an app without one
                    log.info("ASGI 'lifespan' protocol appears unsupported: %r", exc)
                    settle(None)
                if not isinstance(exc, Exception):
                    raise
            else:
                settle(None)  # returned: nothing (more) to run, as uvicorn takes it

        self._task = asyncio.create_task(run(), name="rollbox-asgi-lifespan")
        try:
            await startup
        except BaseException:
            await self._finish()
            raise
        return self.state

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            assert self._shutdown is not None
            await self._shutdown
        finally:
            await self._finish()

    async def _finish(self) -> None:
        if self._task is not None:
            self._stop.set()
            with contextlib.suppress(Exception):
                await self._task
            for step in (self._startup, self._shutdown):
                if step is not None and step.done() and not step.cancelled():
                    step.exception()  # retrieved: no "never retrieved" warning


class _Body:
    """An answer's body between the app (``put``) and the reader (``get``), at most
    BODY_DEPTH chunks held. One writer, one reader."""

    COMPLETE = object()  # the app sent its last chunk

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes] = collections.deque()
        self.end: object | None = None  # COMPLETE, or the error reading on meets
        self.dropped = False  # the reader went away: chunks are discarded
        self._readable = asyncio.Event()
        self._room = asyncio.Event()

    async def put(self, chunk: bytes) -> None:
        while len(self.chunks) >= BODY_DEPTH and not self.dropped:
            self._room.clear()
            await self._room.wait()
        if not self.dropped:
            self.chunks.append(chunk)
            self._readable.set()

    def finish(self, end: object) -> None:
        if self.end is None:
            self.end = end
            self._readable.set()

    async def get(self) -> bytes | object:
        while not self.chunks and self.end is None:
            self._readable.clear()
            await self._readable.wait()
        if self.chunks:
            chunk = self.chunks.popleft()
            self._room.set()
            return chunk
        return self.end

    def drop(self) -> None:
        self.dropped = True
        self.chunks.clear()
        self._room.set()


class _Call:
    """One request through the app: its receive/send, run as a task of its own."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: Any) -> None:
        self.app = app
        self.scope = scope
        self._body: AsyncIterator[bytes] | None = None
        self._whole: bytes | None = None
        if isinstance(body, AsyncIterable):
            self._body = aiter(body)
        else:
            self._whole = bytes(body or b"")
        self._request_done = False
        self.gone = asyncio.Event()  # the answer is complete, or the client went away
        self.head: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = (
            asyncio.get_running_loop().create_future())
        self.answer = _Body()
        self.body_error: BaseException | None = None

    async def receive(self) -> Message:
        if not self._request_done and not self.gone.is_set():
            if self._body is None:
                self._request_done = True
                return {"type": "http.request", "body": self._whole, "more_body": False}
            try:
                chunk = await anext(self._body)
            except StopAsyncIteration:
                self._request_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            except Exception as exc:  # the client's body failed: it gives up the request
                self.body_error = exc
                lost = errors.ConnectionLost(f"request body failed: {exc!r}")
                lost.__cause__ = exc
                self._fail_head(lost)
                self.disconnect()
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": bytes(chunk), "more_body": True}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: Message) -> None:
        if self.gone.is_set():
            return  # the client is gone (or the answer complete): dropped, as a server does
        if msg["type"] == "http.response.start":
            if not self.head.done():
                self.head.set_result((int(msg["status"]), list(msg.get("headers", []))))
        elif msg["type"] == "http.response.body":
            if self.scope["method"] != "HEAD" and msg.get("body"):
                await self.answer.put(bytes(msg["body"]))
            if not msg.get("more_body", False):
                self.answer.finish(_Body.COMPLETE)
                self.gone.set()

    def _fail_head(self, exc: BaseException) -> None:
        if not self.head.done():
            self.head.set_exception(exc)

    def disconnect(self) -> None:
        """The client went away: the app's receive says so, what it sends is dropped."""
        self.gone.set()
        self.answer.drop()

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.receive, self.send)
        except Exception as exc:
            if self.body_error is None:  # as uvicorn logs it (the client's own failure: not)
                log.error("Exception in ASGI application", exc_info=exc)
            self._settle("the app failed")
        except BaseException:
            self._settle("the app was cancelled")
            raise
        else:
            self._settle("the app returned without finishing its answer")
        finally:
            close = getattr(self._body, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    def _settle(self, why: str) -> None:
        """The app is done: a reader still waiting gets what a server would have sent."""
        if not self.head.done():  # as uvicorn: a plain 500 when nothing was sent yet
            self.head.set_result((500, [(b"content-type", b"text/plain; charset=utf-8")]))
            self.answer.chunks.append(b"Internal Server Error")
            self.answer.finish(_Body.COMPLETE)
        else:  # a no-op once the answer is complete
            self.answer.finish(errors.ConnectionLost(f"stream broken: {why}"))
        self.gone.set()


class ASGIResponse:
    def __init__(self, call: _Call, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._call = call
        self.status = status
        self.headers = headers

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._call.answer.get()
            if isinstance(item, bytes):
                yield item
            elif item is _Body.COMPLETE:
                return
            else:
                assert isinstance(item, BaseException)
                raise item

    async def aclose(self) -> None:
        self._call.disconnect()  # a disconnect only if the answer was not complete


class ASGITransport:
    """Requests call ``app`` in the running loop. ``lifespan``: the transport runs the app's
    start-up before its first request and its shutdown when closed, as a server would; pass
    False when something else runs it (several clients of one app: see :class:`Lifespan`).
    Closing also ends requests still running, as a server shutting down does (after
    GRACE_S)."""

    def __init__(self, app: ASGIApp, *, lifespan: bool = True,
                 client: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.app = app
        self.base_url = f"http://{HOST}"
        self.client = client
        self._lifespan = Lifespan(app) if lifespan else None
        self._state: dict[str, Any] = {}
        self._started: asyncio.Task[dict[str, Any]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[asyncio.Task[None], _Call] = {}
        self._ready = False  # the app has started (or needs no start-up from here)
        self._closed = False

    async def _start(self) -> None:
        if self._ready:
            return
        self._loop = asyncio.get_running_loop()
        if self._lifespan is not None:
            if self._started is None:  # one start-up, whoever asks first
                self._started = asyncio.ensure_future(self._lifespan.__aenter__())
            try:
                self._state = await asyncio.shield(self._started)
            except RuntimeError as exc:
                raise errors.ServerUnreachable(f"the app did not start: {exc}") from exc
        self._ready = True

    def _scope(self, request: Request) -> dict[str, Any]:
        path, _, query = request.target.partition("?")
        if request.params:
            extra = urllib.parse.urlencode(list(request.params))
            query = f"{query}&{extra}" if query else extra
        # Percent-encode what is not yet (as yarl does on the HTTP path).
        path = urllib.parse.quote(path, safe=_PATH_SAFE)
        query = urllib.parse.quote(query, safe=_QUERY_SAFE)
        headers = [(b"host", HOST.encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in (request.headers or {}).items()]
        if isinstance(request.body, AsyncIterable):
            headers.append((b"transfer-encoding", b"chunked"))
        elif request.body is not None or request.method in ("POST", "PUT", "PATCH"):
            headers.append((b"content-length", str(len(request.body or b"")).encode()))
        return {
            "type": "http", "asgi": ASGI, "http_version": "1.1", "method": request.method,
            "scheme": "http", "path": urllib.parse.unquote(path),
            "raw_path": path.encode("ascii"), "query_string": query.encode("ascii"),
            "root_path": "", "headers": headers, "server": (HOST, 80), "client": self.client,
            "state": dict(self._state),
        }

    async def handle(self, request: Request) -> ASGIResponse:
        if self._closed:
            raise RuntimeError("the rollbox client has been closed")
        await self._start()
        call = _Call(self.app, self._scope(request), request.body)
        task = asyncio.create_task(call.run(), name=f"rollbox-asgi {request.method}")
        self._calls[task] = call
        task.add_done_callback(self._calls.pop)
        try:
            status, headers = await asyncio.shield(call.head)
        except BaseException:
            call.disconnect()  # cancelled: the client went away (the app's work goes on)
            raise
        return ASGIResponse(call, status, headers)

    def blocking(self, timeout_s: float) -> LoopTransport:
        return LoopTransport(self, timeout_s)

    async def aclose(self) -> None:
        self._closed = True
        for call in self._calls.values():
            call.disconnect()
        if self._calls:
            _, pending = await asyncio.wait(set(self._calls), timeout=GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._started is not None and self._lifespan is not None:
            started, self._started = self._started, None
            if not started.done():
                started.cancel()
            await asyncio.wait({started})
            if not started.cancelled() and started.exception() is None:
                await self._lifespan.__aexit__(None, None, None)


class LoopTransport:
    """Blocking requests from another thread, run on the loop the transport serves on (the
    app lives there: in-process, a blocked loop blocks the app too)."""

    def __init__(self, transport: ASGITransport, timeout_s: float) -> None:
        self.transport = transport
        self.timeout_s = timeout_s

    async def _round_trip(self, request: Request) -> tuple[int, bytes]:
        resp = await self.transport.handle(request)
        try:
            return resp.status, await resp.read()
        finally:
            await resp.aclose()

    def handle(self, request: Request) -> tuple[int, bytes]:
        what = f"{request.method} {request.target}"
        loop = self.transport._loop
        try:
            if loop is None or loop.is_closed():
                raise RuntimeError("no loop")
            future = asyncio.run_coroutine_threadsafe(self._round_trip(request), loop)
        except RuntimeError as exc:
            raise errors.ServerUnreachable(f"{what}: the app's loop is not running") from exc
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise errors.ConnectionLost(f"{what}: no answer in {self.timeout_s} s") from None
        except RuntimeError as exc:  # the transport closed meanwhile
            raise errors.ServerUnreachable(f"{what}: {exc}") from exc

    def close(self) -> None:
        pass
