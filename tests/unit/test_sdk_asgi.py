"""The SDK's in-process transport (ASGITransport): answers stream as the app sends them, an
early close is a disconnect to the app, failures read as they do over HTTP, the request's
bytes and headers are an HTTP client's, the app's lifespan runs around it, job heartbeats go
through it; and the SDK imports nothing of the server side.

Against small raw ASGI / Starlette apps (exact messages) and the real api with the test-only
FakeEdge (ApiStack, ``serve=False``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import rollbox
from rollbox import errors
from rollbox.sdk import ASGITransport, _asgi
from rollbox.sdk._transport import Request as SdkRequest
from test_api_support import ApiStack

Message = dict[str, Any]


class RawApp:
    """An ASGI app that records each request (scope, body messages) and answers with
    ``handler(receive, send)``."""

    def __init__(self, handler: Any = None) -> None:
        self.handler = handler or self.ok
        self.scopes: list[dict[str, Any]] = []
        self.bodies: list[list[Message]] = []

    @staticmethod
    async def ok(receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"[]"})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.scopes.append(scope)
        got: list[Message] = []
        self.bodies.append(got)

        async def recording_receive() -> Message:
            msg = await receive()
            got.append(msg)
            return msg

        await self.handler(recording_receive, send)


def client(app: Any, **kw: Any) -> rollbox.AsyncClient:
    return rollbox.AsyncClient(api_key="rbx_k", transport=ASGITransport(app, **kw))


async def test_answers_stream_as_sent_and_lines_may_be_long() -> None:
    gate = asyncio.Event()
    big = "x" * (400 << 10)

    async def ndjson(receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"n": 1}\n{"n"', "more_body": True})
        await gate.wait()
        await send({"type": "http.response.body", "more_body": True,
                    "body": b': 2}\n' + json.dumps({"n": 3, "big": big}).encode() + b"\n"})
        await send({"type": "http.response.body", "body": b""})

    async with client(RawApp(ndjson)) as c:
        lines = c._t.lines(await c._t.stream("GET", "/s"))
        assert await asyncio.wait_for(lines.__anext__(), 2) == {"n": 1}  # before the rest
        gate.set()
        assert await lines.__anext__() == {"n": 2}
        assert (await lines.__anext__())["big"] == big
        with pytest.raises(StopAsyncIteration):
            await lines.__anext__()


async def test_a_slow_reader_holds_the_app_back() -> None:
    sent = 0

    async def flood(receive: Any, send: Any) -> None:
        nonlocal sent
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(1000):
            await send({"type": "http.response.body", "body": b"x" * 1024, "more_body": True})
            sent += 1
        await send({"type": "http.response.body", "body": b""})

    async with client(RawApp(flood)) as c:
        resp = await c._t.stream("GET", "/flood")
        await asyncio.sleep(0.2)
        assert sent <= _asgi.BODY_DEPTH + 1  # bounded, not the whole answer in memory
        assert len(b"".join([x async for x in resp.chunks()])) == 1000 * 1024
        await resp.aclose()


async def test_closing_a_stream_early_is_a_disconnect_to_the_app() -> None:
    ended = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"first\n"
            await asyncio.sleep(30)
            yield b"never\n"
        finally:
            ended.set()

    async def stream(request: Request) -> Response:
        return StreamingResponse(events(), media_type="application/x-ndjson")

    app = Starlette(routes=[Route("/s", stream)])
    async with client(app) as c:
        resp = await c._t.stream("GET", "/s")
        chunks = resp.chunks()
        assert await chunks.__anext__() == b"first\n"
        await resp.aclose()
        await asyncio.wait_for(ended.wait(), 2)  # the app's generator ended, not at 30 s


async def test_app_failures_read_as_over_http(caplog: pytest.LogCaptureFixture) -> None:
    async def before_answering(receive: Any, send: Any) -> None:
        raise RuntimeError("kaboom")

    async def mid_answer(receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"half", "more_body": True})
        raise RuntimeError("kaboom")

    async def no_answer(receive: Any, send: Any) -> None:
        return

    for handler in (before_answering, no_answer):  # uvicorn's plain 500
        async with client(RawApp(handler)) as c:
            with pytest.raises(errors.InfraError) as ei:
                await c.health()
            assert ei.value.retryable and "Internal Server Error" in ei.value.message
    assert "kaboom" in caplog.text  # logged, as a server logs it
    async with client(RawApp(mid_answer)) as c:
        resp = await c._t.stream("GET", "/s")
        with pytest.raises(errors.ConnectionLost):
            _ = [x async for x in resp.chunks()]
        await resp.aclose()


async def test_requests_carry_what_an_http_client_sends() -> None:
    app = RawApp(_read_all_then_ok)
    async with client(app) as c:
        await c.list(labels={"a": "1", "b": "x y"}, state=["running", "paused"])
        await c._t.request("POST", "/p", params={"t": True, "f": False, "n": 3},
                           json={"s": "é", "l": [1]})

        async def parts() -> AsyncIterator[bytes]:
            yield b"ab"
            yield b"cd"

        await c._t.request("PUT", "/v1/jobs/a%20b?project=p", params={"x": "/y"},
                           content=parts())
    get, post, put = app.scopes
    assert get["method"] == "GET" and get["path"] == "/v1/sandboxes"
    # The bytes aiohttp puts on the wire (test_sdk_transport's raw server sees them).
    assert get["query_string"] == b"label=a%3D1&label=b%3Dx+y&state=running&state=paused"
    assert (b"authorization", b"Bearer rbx_k") in get["headers"]
    assert post["query_string"] == b"t=true&f=false&n=3"
    assert (b"content-type", b"application/json") in post["headers"]
    assert [json.loads(m["body"]) for m in app.bodies[1] if m["body"]] == [{"s": "é", "l": [1]}]
    assert (put["path"], put["raw_path"]) == ("/v1/jobs/a b", b"/v1/jobs/a%20b")
    assert put["query_string"] == b"project=p&x=%2Fy"
    assert [(m["body"], m["more_body"]) for m in app.bodies[2]] == [
        (b"ab", True), (b"cd", True), (b"", False)]  # streamed in as sent


async def test_a_failing_request_body_is_raised_to_the_client_and_a_disconnect_to_the_app(
) -> None:
    app = RawApp(_read_all_then_ok)

    async def broken() -> AsyncIterator[bytes]:
        yield b"ab"
        raise PermissionError("denied")

    async with client(app) as c:
        with pytest.raises(errors.ConnectionLost) as ei:
            await c._t.request("PUT", "/up", content=broken())
        assert isinstance(ei.value.__cause__, PermissionError)
        assert app.bodies[0][-1] == {"type": "http.disconnect"}
        assert (await c._t.request("GET", "/ok")).status_code == 200  # the client goes on


async def _read_all_then_ok(receive: Any, send: Any) -> None:
    while (msg := await receive())["type"] == "http.request" and msg.get("more_body"):
        pass
    if msg["type"] == "http.disconnect":
        return
    await RawApp.ok(receive, send)


async def test_the_apps_lifespan_runs_around_the_transport() -> None:
    seen: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        seen.append("startup")
        yield
        seen.append("shutdown")

    async def health(request: Request) -> Response:
        seen.append("request")
        return Response(b'{"status":"ok"}', media_type="application/json")

    app = Starlette(routes=[Route("/v1/health", health)], lifespan=lifespan)
    c = client(app)
    assert seen == []  # nothing before the first request
    assert await c.health() == {"status": "ok"}
    await c.health()
    assert seen == ["startup", "request", "request"]
    await c.close()
    assert seen == ["startup", "request", "request", "shutdown"]
    with pytest.raises(RuntimeError):
        await c.health()  # closed stays closed

    seen.clear()
    async with client(app, lifespan=False) as c:  # someone else runs it
        await c.health()
    assert seen == ["request"]

    @contextlib.asynccontextmanager
    async def failing(app: Starlette) -> AsyncIterator[None]:
        raise OSError("no disk")
        yield

    broken = Starlette(routes=[Route("/v1/health", health)], lifespan=failing)
    async with client(broken) as c:
        with pytest.raises(errors.ServerUnreachable, match="no disk"):
            await c.health()

    async def http_only(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"  # no lifespan at all: served all the same (uvicorn's auto)
        await RawApp.ok(receive, send)

    async with client(http_only) as c:
        assert await c._t.request("GET", "/") is not None


async def test_closing_ends_requests_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_asgi, "GRACE_S", 0.2)
    cancelled = asyncio.Event()

    async def forever(request: Request) -> Response:
        try:
            await asyncio.sleep(30)
        finally:
            cancelled.set()
        return Response()

    c = client(Starlette(routes=[Route("/slow", forever)]))
    pending = asyncio.ensure_future(c._t.request("GET", "/slow"))
    await asyncio.sleep(0.1)
    await asyncio.wait_for(c.close(), 5)
    assert cancelled.is_set()
    with pytest.raises(errors.InfraError):  # as a request cut by a closing session
        await pending


async def test_job_heartbeats_go_through_the_app(tmp_path: Path) -> None:
    async with ApiStack(tmp_path, serve=False, leases=True) as s, s.client(s.key_a) as c:
        job = await c.job("run-1", heartbeat_s=1.0).open()
        assert job.info is not None
        opened = job.info.heartbeat_at
        deadline = time.monotonic() + 10
        while (await job.refresh()).heartbeat_at == opened:  # the thread's beat landed
            assert time.monotonic() < deadline, "no heartbeat reached the app"
            await asyncio.sleep(0.1)
        assert job.lost is None and job._heartbeat is not None
        assert job._heartbeat.last_ok is not None
        await job.end()


async def test_blocking_requests_run_on_the_apps_loop() -> None:
    async with client(RawApp()) as c:
        await c.health()  # the transport knows its loop from here on
        channel = c._t.transport.blocking(0.5)
        req = SdkRequest("GET", "/v1/health", headers={"Authorization": "Bearer rbx_k"})
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(channel.handle(req)))
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.01)
        assert got == [(200, b"[]")]

        def blocked() -> None:
            try:
                channel.handle(req)
            except errors.RollboxError as exc:
                got.append(exc)

        thread = threading.Thread(target=blocked)
        thread.start()
        thread.join(5)  # this loop is blocked: in-process, the app is too
        assert isinstance(got[-1], errors.ConnectionLost) and got[-1].retryable
        channel.close()


def test_the_sdk_imports_nothing_of_the_server_side() -> None:
    probe = ("import sys, rollbox, rollbox.sdk; c = rollbox.AsyncClient('http://x:1', 'k'); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('fastapi', 'starlette', 'uvicorn') or m.startswith('rollbox.') and "
             "m.split('.')[1] not in ('sdk', 'errors', 'models', 'trace')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
