"""A broken edge must not crash the api with a decoder's exception: every malformed answer
RemoteEdge reads (bad JSON, a short frame, an error payload that is no error, a bytes result
over its max_bytes) is a typed InfraError. The edge here is a fake HTTP server answering the
frames each case gives (what is under test is RemoteEdge's parsing, not an edge)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rollbox import errors
from rollbox.agent.protocol import ExecRequest
from rollbox.edge import wire
from rollbox.edge.remote import RemoteEdge

SID = "img-0123abcd"
ANSWERS: dict[str, tuple[int, bytes]] = {
    # route -> (status, body)
    "/call/get": (200, wire.frame(wire.JSON_ITEM, b'{"not": "a sandbox"') + wire.DONE_FRAME),
    "/call/list": (200, wire.frame(wire.JSON_ITEM, b'[{"id": 1}]') + wire.DONE_FRAME),
    "/call/delete": (200, wire.frame(wire.ERROR, b"<html>oops")),
    "/call/pause": (200, wire.error_frame(errors.NotFound("x")).replace(b'"details":{}',
                                                                          b'"details":[1]')),
    "/call/resume": (404, json.dumps({"error": {"code": "not_found", "message": "m",
                                                "details": {"message": 2}}}).encode()),
    "/call/file_read": (200, wire.frame(wire.DATA, b"x" * 4096) * 3 + wire.DONE_FRAME),
    "/stream/exec_stream": (200, wire.frame(wire.STDOUT, b"\0\0") + wire.DONE_FRAME),
    "/stream/events": (200, wire.frame(wire.JSON_ITEM, b"{}") + wire.DONE_FRAME),
    "/platform_exec": (200, wire.frame(wire.JSON_ITEM, b"[]") + wire.DONE_FRAME),
}


@pytest.fixture
async def edge() -> AsyncIterator[RemoteEdge]:
    async def handler(request: web.Request) -> web.Response:
        status, body = ANSWERS[request.path.removeprefix(wire.PREFIX)]
        return web.Response(status=status, body=body,
                            content_type="application/json" if status != 200 else "application/x-rollbox-frames")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    remote = RemoteEdge("n0", f"http://127.0.0.1:{port}", "t" * 32)
    try:
        yield remote
    finally:
        await remote.close()
        await runner.cleanup()


async def test_malformed_unary_answers_are_infra_errors(edge: RemoteEdge) -> None:
    for call in (edge.get(SID), edge.list(None, {}), edge.delete(SID), edge.pause(SID),
                 edge.resume(SID), edge.file_read(SID, "/f", 5000)):
        with pytest.raises(errors.InfraError) as exc:
            await call
        assert type(exc.value) is errors.InfraError, repr(exc.value)
    # Within its max_bytes the same answer is the data.
    assert await edge.file_read(SID, "/f", 3 * 4096) == b"x" * 3 * 4096


async def test_malformed_stream_items_are_infra_errors(edge: RemoteEdge) -> None:
    with pytest.raises(errors.InfraError):
        async for _ in edge.exec_stream(SID, "e1"):
            pass
    with pytest.raises(errors.InfraError):
        async for _ in edge.events(SID, 0, False):
            pass
    with pytest.raises(errors.InfraError):
        await edge.platform_exec(SID, ExecRequest(argv=["true"], env=[]))
