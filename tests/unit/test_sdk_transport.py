"""The SDK's aiohttp transport: typed errors, timeouts, streaming, headers and clean closing.

Against a scripted raw HTTP/1.1 server on loopback (exact bytes on the wire) and the real api
with the test-only FakeEdge (ApiStack); error answers and a body's own error also in-process
(test_sdk_asgi.py has the ASGI transport's own tests).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import rollbox
from rollbox import errors
from rollbox.sdk import AiohttpTransport, ASGITransport
from test_api_support import ApiStack

Handler = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Loopback HTTP/1.1 server: ``handler(head, body, writer)`` writes the answer itself."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lower = head.lower()
                body = b""
                if b"transfer-encoding: chunked" in lower:
                    while True:
                        size = int((await reader.readline()).strip(), 16)
                        chunk = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        body += chunk[:-2]
                elif b"content-length:" in lower:
                    n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(n)
                self.requests.append((head, body))
                await self.handler(head, body, writer)
                if writer.is_closing():
                    return
        finally:
            self.tasks.discard(task)
            writer.close()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):  # handlers still serving (e.g. never answering)
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


def respond(status: int, body: bytes, ctype: str = "application/json") -> Handler:
    async def handler(head: bytes, req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                % (status, ctype.encode(), len(body)) + body)
        await w.drain()
    return handler


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[ApiStack]:
    async with ApiStack(tmp_path) as s:
        yield s


@pytest.fixture(params=["http", "asgi"])
async def either_stack(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ApiStack]:
    """The stack served over HTTP, or called in-process (ASGITransport)."""
    async with ApiStack(tmp_path, serve=request.param == "http") as s:
        yield s


async def test_transport_failures_are_retryable_infra_errors() -> None:
    async def hang_up(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.close()

    async def never_answer(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async def half_body(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"x\":")
        await w.drain()
        w.close()

    for handler in (hang_up, never_answer, half_body):
        async with RawServer(handler) as srv, rollbox.AsyncClient(srv.url, "k", timeout=0.5) as c:
            with pytest.raises(errors.InfraError) as ei:
                await c.health()
            assert ei.value.retryable, handler.__name__
    async with rollbox.AsyncClient("http://127.0.0.1:9", "k", timeout=2) as dead:
        with pytest.raises(errors.InfraError):  # connection refused
            await dead.list()
        with pytest.raises(errors.InfraError):  # same on the streamed path
            await dead._t.stream("GET", "/v1/sandboxes/x/events")


@contextlib.asynccontextmanager
async def answering(transport: str, status: int, body: bytes) -> AsyncIterator[rollbox.AsyncClient]:
    """A client whose every request is answered ``status`` and ``body``: by a raw HTTP server,
    or by an ASGI app in-process."""
    if transport == "http":
        async with RawServer(respond(status, body)) as srv, rollbox.AsyncClient(srv.url, "k") as c:
            yield c
        return

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": body})

    async with rollbox.AsyncClient(api_key="k", transport=ASGITransport(app)) as c:
        yield c


@pytest.mark.parametrize("transport", ["http", "asgi"])
@pytest.mark.parametrize("status,body", [
    (404, b'{"error":{"code":"not_found","message":"no such sandbox"}}'),
    (409, b'{"error":{"code":"sandbox_dead","message":"oom","details":{}}}'),
    (429, b'{"error":{"code":"capacity_exceeded","message":"full"}}'),
    (502, b"<html>bad gateway</html>"),
    (400, b"plain words"),
])
async def test_http_errors_are_the_payloads_typed_error(status: int, body: bytes,
                                                        transport: str) -> None:
    try:
        payload: Any = json.loads(body)
    except ValueError:
        payload = body.decode()
    want = errors.error_from_payload(payload, status)
    async with answering(transport, status, body) as c:
        with pytest.raises(errors.RollboxError) as ei:
            await c.get("sb-1")
        assert type(ei.value) is type(want) and str(ei.value) == str(want)
        with pytest.raises(errors.RollboxError) as ei2:  # streamed requests too
            await c._t.stream("GET", "/v1/sandboxes/sb-1/events")
        assert type(ei2.value) is type(want) and str(ei2.value) == str(want)


async def test_auth_header_query_and_json_body_on_the_wire() -> None:
    async with RawServer(respond(200, b"[]")) as srv, rollbox.AsyncClient(srv.url, "rbx_k") as c:
        await c.list(labels={"a": "1", "b": "x y"}, state=["running", "paused"])
        await c._t.request("POST", "/p", params={"t": True, "f": False, "n": 3},
                           json={"s": "é", "l": [1]})
        head, _ = srv.requests[0]
        assert head.startswith(b"GET /v1/sandboxes?label=a%3D1&label=b%3Dx+y&state=running"
                               b"&state=paused HTTP/1.1")
        assert b"\r\nauthorization: bearer rbx_k\r\n" in head.lower()
        head, body = srv.requests[1]
        assert head.startswith(b"POST /p?t=true&f=false&n=3 HTTP/1.1")
        assert b"content-type: application/json" in head.lower()
        assert json.loads(body) == {"s": "é", "l": [1]}


async def test_ndjson_lines_arrive_as_written_and_may_be_long() -> None:
    gate = asyncio.Event()
    big = "x" * (400 << 10)  # longer than aiohttp's readline limit

    async def ndjson(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")

        def chunk(data: bytes) -> None:
            w.write(b"%x\r\n%s\r\n" % (len(data), data))

        chunk(b'{"n": 1}\n{"n"')  # a line split across chunks
        await w.drain()
        await gate.wait()
        chunk(b': 2}\n' + json.dumps({"n": 3, "big": big}).encode() + b"\n")
        chunk(b"")
        await w.drain()

    async with RawServer(ndjson) as srv, rollbox.AsyncClient(srv.url, "k", timeout=1.0) as c:
        # The timeout also bounds the connect, which took > 0.3 s once in a clean-clone CI at a
        # load average of 30 on 2 cores: 1 s here, and the silence below is longer still.
        lines = c._t.lines(await c._t.stream("GET", "/s"))
        assert await asyncio.wait_for(lines.__anext__(), 2) == {"n": 1}  # before the rest
        await asyncio.sleep(1.5)  # silent longer than the client timeout: no read timeout
        gate.set()
        assert await lines.__anext__() == {"n": 2}
        assert (await lines.__anext__())["big"] == big
        with pytest.raises(StopAsyncIteration):
            await lines.__anext__()


async def test_long_exec_streams_past_the_client_timeout(stack: ApiStack) -> None:
    async with rollbox.AsyncClient(stack.url, stack.key_a, timeout=0.5) as c:
        async with await c.create("debian") as sb:
            loop = asyncio.get_running_loop()
            seen: list[tuple[float, str]] = []
            t0 = loop.time()
            res = await sb.exec("echo start; sleep 1.5; echo end",
                                on_stdout=lambda s: seen.append((loop.time() - t0, s)))
            assert res.exit_code == 0 and "".join(s for _, s in seen) == "start\nend\n"
            assert seen[0][0] < 1.0  # streamed, not buffered until the end
            res = await sb.exec("sleep 1.2; echo quiet")  # the one-answer (wait=1) path
            assert res.stdout == "quiet\n"
            proc = await sb.exec_background("sleep 1.2")
            assert (await proc.wait()).exit_code == 0


async def test_no_unclosed_session_warnings(stack: ApiStack) -> None:
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: reports.append(ctx))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idle = rollbox.AsyncClient(stack.url, stack.key_a)
            transport = idle._t.transport
            assert isinstance(transport, AiohttpTransport)
            assert transport._session is None  # made lazily, on the first request
            await idle.close()
            async with rollbox.AsyncClient(stack.url, stack.key_a) as c:
                sb = await c.create("debian")
                await sb.exec("echo hi", on_stdout=lambda s: None)
                kinds = [e.kind async for e in sb.stream_events(follow=False)]
                assert kinds[0] == "sandbox.created"
                await sb.delete()
            with pytest.raises(RuntimeError):
                await c.list()  # closed stays closed
            del c, sb, idle, transport
            gc.collect()
            await asyncio.sleep(0.1)
            gc.collect()
        bad = [w for w in caught if "nclosed" in str(w.message)]
        assert not bad, bad
        assert not reports, reports
        # Control: the same check does see a session left open.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            leaky = rollbox.AsyncClient("http://127.0.0.1:9", "k")
            with pytest.raises(errors.InfraError):
                await leaky.list()
            del leaky
            gc.collect()
            await asyncio.sleep(0.1)
            gc.collect()
        assert [w for w in caught if "nclosed client session" in str(w.message)]
        assert reports
    finally:
        loop.set_exception_handler(old)


def test_client_made_outside_a_loop(stack_thread_url: tuple[str, str]) -> None:
    url, key = stack_thread_url
    c = rollbox.AsyncClient(url, key)  # no running loop here

    async def use() -> int:
        async with c:
            return len(await c.list())

    assert asyncio.run(use()) == 0
    with rollbox.Client(url, key) as sc:
        assert sc.list() == []


@pytest.fixture
def stack_thread_url(tmp_path: Path) -> Any:
    import threading
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        holder["stop"] = asyncio.Event()
        async with ApiStack(tmp_path) as s:
            holder["s"] = s
            ready.set()
            await holder["stop"].wait()

    t = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    t.start()
    try:
        assert ready.wait(10)
        yield holder["s"].url, holder["s"].key_a
    finally:
        if "stop" in holder:
            loop.call_soon_threadsafe(holder["stop"].set)
        t.join(30)
        loop.close()


async def test_upload_dir_raises_the_producers_own_error(
        either_stack: ApiStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tarfile
    src = tmp_path / "up"
    src.mkdir()
    (src / "a.txt").write_text("x" * (1 << 20))

    def unreadable(self: tarfile.TarFile, *a: Any, **kw: Any) -> None:
        raise PermissionError("denied: a.txt")

    async with either_stack.client(either_stack.key_a) as c:
        async with await c.create("debian") as sb:
            assert await sb.files.upload_dir(src, "/up") > 0  # the real path works
            monkeypatch.setattr(tarfile.TarFile, "add", unreadable)
            with pytest.raises(PermissionError, match="denied"):  # not a retryable InfraError
                await sb.files.upload_dir(src, "/up2")


async def test_max_connections_bounds_open_connections() -> None:
    live = 0
    peak = 0

    async def slow(head: bytes, body: bytes, w: asyncio.StreamWriter) -> None:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.2)
        live -= 1
        await respond(200, b'{"status":"ok"}')(head, body, w)

    async with RawServer(slow) as srv, \
            rollbox.AsyncClient(srv.url, "k", max_connections=2) as c:
        got = await asyncio.gather(*(c.health() for _ in range(6)))
    assert got == [{"status": "ok"}] * 6
    assert peak == 2
