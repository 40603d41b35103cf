"""Request and sandbox ids (``rollbox.trace``): every api answer carries a request id (the
client's if it is a short token, else a new one), every error body repeats it, the SDK sets
``err.request_id`` on every error it raises for a call (also when the call never got there),
the api's log line for an error names the same id and sandbox, and JSON log lines carry the
ids bound where they were made.

Against the real api with the test-only FakeEdge (``ApiStack``), in-process and over HTTP; the
api -> edge hop over HTTP is in tests/integration/test_edge_service.py."""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import aiohttp
import pytest

import rollbox
from rollbox import errors, terminal, trace
from rollbox.models import SandboxSpec
from test_api_support import ApiStack


def test_accepted_ids_and_binding() -> None:
    assert trace.accepted("run-42.step:7_a") == "run-42.step:7_a"
    for bad in (None, "", "a" * 65, "has space", "nl\n", "-leading", "ü", b"\xff", "x;y"):
        got = trace.accepted(bad)
        assert got.startswith("req_") and len(got) == 20, bad
    assert trace.new_request_id() != trace.new_request_id()
    assert trace.current() == {} and trace.outgoing() == {}
    with trace.bound(request="r1", sandbox="n0-abc"):
        assert trace.current() == {"request_id": "r1", "sandbox_id": "n0-abc"}
        assert trace.outgoing() == {"X-Request-Id": "r1"}
        with trace.bound(exec_="e1"):
            assert trace.current()["exec_id"] == "e1"
        assert "exec_id" not in trace.current()
    assert trace.current() == {}


def test_json_log_lines_carry_the_ids_and_escape_everything() -> None:
    terminal.stamp_trace_ids()
    terminal.stamp_trace_ids()  # once per process, however often asked
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(terminal.JsonFormatter())
    log = logging.getLogger("rollbox.test.trace")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with trace.bound(request="req_1", sandbox="n0-x", exec_="e9"):
            record = log.makeRecord(log.name, logging.INFO, __file__, 1, "kept %s", ("\x1b[2J",),
                                    None)
        log.info("bidi \u202e and \x1b]52;c;?\x07 in %s", "argv")
        log.handle(record)  # formatted outside the block: the ids it was made with
        try:
            raise ValueError("tb\x1b")
        except ValueError:
            log.exception("boom")
    finally:
        log.removeHandler(handler)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert not any(c in buf.getvalue() for c in ("\x1b", "\x07", "\u202e"))
    first, second, third = (json.loads(x) for x in lines)
    assert "request_id" not in first and first["msg"] == "bidi \u202e and \x1b]52;c;?\x07 in argv"
    assert second["request_id"] == "req_1" and second["sandbox_id"] == "n0-x"
    assert second["exec_id"] == "e9" and second["msg"] == "kept \x1b[2J"
    assert third["level"] == "ERROR" and "ValueError: tb\x1b" in third["exc"]
    assert first["ts"].endswith("Z") and first["logger"] == "rollbox.test.trace"


@pytest.mark.parametrize("serve", [False, True], ids=["asgi", "http"])
async def test_answers_errors_and_logs_share_the_request_id(
        tmp_path: Path, serve: bool, caplog: pytest.LogCaptureFixture) -> None:
    terminal.stamp_trace_ids()
    caplog.set_level(logging.INFO, logger="rollbox.api")
    async with ApiStack(tmp_path, serve=serve) as s, s.client(s.key_a) as c:
        sb = await c.create("busybox:test")
        # An error raised for a call names its request id; the api's line names it too.
        with pytest.raises(errors.NotFound) as ei:
            await c._t.request("GET", f"/v1/sandboxes/{sb.id}/files", params={"path": "/nope"})
        rid = ei.value.request_id
        assert rid is not None and rid.startswith("req_")
        lines = [r for r in caplog.records if r.name == "rollbox.api.errors"
                 and r.trace_ids.get("request_id") == rid]
        assert len(lines) == 1, [(r.getMessage(), r.trace_ids) for r in caplog.records]
        assert lines[0].trace_ids.get("sandbox_id") == sb.id
        assert "404 not_found" in lines[0].getMessage()
        # Each call its own id.
        with pytest.raises(errors.NotFound) as again:
            await c.get("n0-000000000000")
        assert again.value.request_id not in (None, rid)
        # The api's own validation: an id too (the SDK's checks before sending raise none).
        with pytest.raises(errors.BadRequest) as bad:
            await c._t.request("POST", "/v1/sandboxes", json={"image": 5, "ttl_s": -5})
        assert (bad.value.request_id or "").startswith("req_")
        await sb.delete()
        if serve:
            async with aiohttp.ClientSession() as h:
                auth = {"Authorization": f"Bearer {s.key_a}"}
                # the client's own id, kept and echoed in header and body
                async with h.get(f"{s.url}/v1/sandboxes/{sb.id}",
                                 headers={**auth, "X-Request-Id": "trainer-run7.ep12"}) as r:
                    body = await r.json()
                    assert r.headers["X-Request-Id"] == "trainer-run7.ep12"
                    assert body["error"]["request_id"] == "trainer-run7.ep12"
                # an unacceptable one replaced; a success carries one too
                async with h.get(f"{s.url}/v1/sandboxes", headers={
                        **auth, "X-Request-Id": "x" * 200}) as r:
                    assert r.status == 200 and r.headers["X-Request-Id"].startswith("req_")
                async with h.get(f"{s.url}/v1/no/such/route", headers=auth) as r:
                    body = await r.json()
                    assert r.status == 404
                    assert body["error"]["request_id"] == r.headers["X-Request-Id"]
                await every_kind_of_answer_carries_one(h, s, auth)


async def every_kind_of_answer_carries_one(h: aiohttp.ClientSession, s: ApiStack,
                                           auth: dict[str, str]) -> None:
    """A 405, a 422 of the api's own validation, a streamed exec answer, an E2B route's answer
    and error, SWE-ReX's key check (a middleware of its front door, before routing) and a
    WebSocket the port proxy refuses (an HTTP answer to the upgrade): each has an
    ``X-Request-Id``, and every typed error body repeats it."""
    async def typed(r: aiohttp.ClientResponse, status: int) -> None:
        assert r.status == status, (r.url, r.status)
        rid = r.headers.get("X-Request-Id", "")
        assert rid.startswith("req_"), (r.url, dict(r.headers))
        assert (await r.json())["error"]["request_id"] == rid

    sb = await s.edges[0].create(SandboxSpec(image="busybox:test"), "proj-a")
    async with h.put(f"{s.url}/v1/health") as r:
        await typed(r, 405)
    async with h.post(f"{s.url}/v1/sandboxes", headers=auth, data=b"{not json") as r:
        await typed(r, 400)
    async with h.post(f"{s.url}/v1/sandboxes/{sb.id}/exec", headers=auth,
                      json={"cmd": ["echo", "hi"]}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"].startswith("req_")
        assert b'"exit"' in await r.read()  # the NDJSON stream, to its end
    e2b = {"X-API-Key": s.key_a}
    async with h.get(f"{s.url}/e2b/sandboxes", headers=e2b) as r:
        assert r.status == 200 and r.headers["X-Request-Id"].startswith("req_")
    async with h.get(f"{s.url}/e2b/sandboxes/n0-000000000000", headers=e2b) as r:
        assert r.status == 404 and r.headers["X-Request-Id"].startswith("req_")
    async with h.get(f"{s.url}/swerex/{sb.id}/is_alive") as r:
        await typed(r, 403)
    with pytest.raises(aiohttp.WSServerHandshakeError) as ws:
        await h.ws_connect(f"{s.url}/v1/sandboxes/{sb.id}/ports/8080/")
    assert ws.value.status == 401 and ws.value.headers is not None
    assert ws.value.headers.get("X-Request-Id", "").startswith("req_")
    await s.edges[0].delete(sb.id)


async def test_an_unreachable_server_still_gives_the_error_a_request_id() -> None:
    async with rollbox.AsyncClient("http://127.0.0.1:9", "k", timeout=5) as c:
        with pytest.raises(errors.ServerUnreachable) as ei:
            await c.get("n0-000000000000")
    assert (ei.value.request_id or "").startswith("req_")
