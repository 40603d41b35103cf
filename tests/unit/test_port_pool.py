"""The port proxy's kept-alive connections (rollbox.api.ports.UpstreamPool) and the resend of
a request whose reused connection the service had closed, on scripted streams (the real
stack: tests/integration/test_ports.py)."""
from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from rollbox import errors
from rollbox.api.ports import PortConfig, PortProxy, Target, UpstreamPool

pytestmark = pytest.mark.asyncio

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Stream:
    """A PortStream whose reads come from a queue the test fills (b"": its end)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.reads: asyncio.Queue[bytes] = asyncio.Queue()
        self.written = bytearray()
        self.closed = False

    async def read(self) -> bytes:
        if self.closed:
            return b""
        return await self.reads.get()

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise errors.SandboxDead("closed")
        self.written += data

    async def write_eof(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
        self.reads.put_nowait(b"")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_take_put_caps_and_keys() -> None:
    pool = UpstreamPool(per_port=2, max_idle=3, idle_s=30)
    assert await pool.take("a", 80) is None
    s1, s2, s3 = Stream("1"), Stream("2"), Stream("3")
    for s in (s1, s2, s3):
        await pool.put("a", 80, s)
    assert s3.closed and not s1.closed and pool.idle("a", 80) == 2  # per port: the extra goes
    assert await pool.take("b", 80) is None and await pool.take("a", 81) is None  # keyed
    b1, b2 = Stream("b1"), Stream("b2")
    await pool.put("b", 80, b1)
    await pool.put("b", 80, b2)  # the 4th idle one in all: the oldest (s1) is closed
    assert s1.closed and pool.idle("a", 80) == 1 and pool.idle("b", 80) == 2
    assert await pool.take("b", 80) is b2  # the newest first
    assert await pool.take("a", 80) is s2 and not s2.closed
    await settle()
    s2.reads.put_nowait(b"late")  # taken: no longer watched, the taker reads it
    assert await s2.read() == b"late"
    await pool.close()
    assert b1.closed and pool.idle("b", 80) == 0


@pytest.mark.parametrize("ending", ["data", "eof", "idle"])
async def test_an_idle_connection_goes_when_the_service_speaks_ends_or_it_idles(
        ending: str) -> None:
    pool = UpstreamPool(idle_s=0.2)
    s = Stream()
    await pool.put("a", 80, s)
    await settle()
    assert pool.idle("a", 80) == 1 and not s.closed
    if ending == "data":
        s.reads.put_nowait(b"HTTP/1.1 200 OK\r\n")  # unasked bytes: out of step
    elif ending == "eof":
        s.reads.put_nowait(b"")  # the service (or the edge, at a delete) closed it
    async with asyncio.timeout(2):
        while pool.idle("a", 80):
            await asyncio.sleep(0.01)
    assert s.closed and await pool.take("a", 80) is None


class Edge:
    def __init__(self, streams: list[Stream]) -> None:
        self.streams = streams
        self.opened = 0

    async def port_open(self, sandbox_id: str, port: int) -> Stream:
        if self.state == "paused":
            raise errors.SandboxPaused("paused")
        self.opened += 1
        return self.streams.pop(0)

    async def wake(self, sandbox_id: str) -> Any:
        return types.SimpleNamespace(state=self.state)

    state = "running"


async def proxied(proxy: PortProxy, edge: Edge, method: str = "GET",
                  body: bytes | None = None) -> list[dict[str, Any]]:
    headers = [(b"host", b"api")]
    if body is not None:
        headers.append((b"content-length", str(len(body)).encode()))
    msgs = [{"type": "http.request", "body": body or b"", "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return msgs.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": method, "headers": headers, "scheme": "http"}
    await proxy.http(scope, receive, send, Target("a", 80, "path", b"/x", ""), edge)  # type: ignore[arg-type]
    return sent


async def test_the_next_request_goes_on_the_kept_connection() -> None:
    pool = UpstreamPool(idle_s=30)
    proxy = PortProxy(app=None, api=None, config=PortConfig.ephemeral(), pool=pool)  # type: ignore[arg-type]
    first = Stream("first")
    edge = Edge([first])
    first.reads.put_nowait(ANSWER)
    sent = await proxied(proxy, edge)
    assert sent[0]["status"] == 200 and sent[-1]["body"] == b"ok"
    assert b"connection: close" not in bytes(first.written).lower()
    assert pool.idle("a", 80) == 1 and not first.closed  # kept
    await settle()
    first.reads.put_nowait(ANSWER)
    sent = await proxied(proxy, edge)
    assert sent[-1]["body"] == b"ok" and edge.opened == 1  # no second connection
    assert bytes(first.written).count(b"GET /x HTTP/1.1") == 2
    # paused (and not woken): refused as port_open refuses it, the kept one left alone
    edge.state = "paused"
    with pytest.raises(errors.SandboxPaused):
        await proxied(proxy, edge)
    assert pool.idle("a", 80) == 1 and bytes(first.written).count(b"GET") == 2
    await pool.close()
    assert first.closed


async def test_resend_after_no_answer_replays_the_body() -> None:
    class Racing(UpstreamPool):
        """Hands out one stale connection, as the race with the service's close leaves it."""

        def __init__(self, stale: Stream) -> None:
            super().__init__(idle_s=30)
            self.stale: Stream | None = stale

        def idle(self, sandbox_id: str, port: int) -> int:
            return 1 if self.stale is not None else super().idle(sandbox_id, port)

        async def take(self, sandbox_id: str, port: int) -> Stream | None:  # type: ignore[override]
            s, self.stale = self.stale, None
            return s

    stale, fresh = Stream("stale"), Stream("fresh")
    stale.reads.put_nowait(b"")  # closed by the service: no answer byte
    fresh.reads.put_nowait(ANSWER)
    pool = Racing(stale)
    proxy = PortProxy(app=None, api=None, config=PortConfig.ephemeral(), pool=pool)  # type: ignore[arg-type]
    edge = Edge([fresh])
    sent = await proxied(proxy, edge, "POST", b"payload")
    assert sent[0]["status"] == 200 and edge.opened == 1
    assert stale.closed
    assert bytes(fresh.written).endswith(b"\r\n\r\npayload")  # the whole request again
    assert pool.idle("a", 80) == 1  # the new one kept
    # a fresh connection that answers nothing is the client's 502, not resent
    dead = Stream("dead")
    dead.reads.put_nowait(b"")
    pool.stale = None
    await pool.close()
    edge2 = Edge([dead])
    with pytest.raises(errors.UpstreamBadResponse, match="without an answer"):
        await proxied(proxy, edge2)
    assert edge2.opened == 1 and dead.closed


@pytest.mark.parametrize("answer, kept", [
    (ANSWER, True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    (ANSWER + b"HTTP/1.1 200 OK\r\n", False),  # more than the answer: out of step
    (b"HTTP/1.1 100 Continue\r\n\r\n" + ANSWER, False),
])
async def test_only_a_whole_kept_alive_answer_keeps_its_connection(answer: bytes,
                                                                   kept: bool) -> None:
    pool = UpstreamPool(idle_s=30)
    proxy = PortProxy(app=None, api=None, config=PortConfig.ephemeral(), pool=pool)  # type: ignore[arg-type]
    s = Stream()
    s.reads.put_nowait(answer)
    if not kept:
        s.reads.put_nowait(b"")  # (an answer read to the connection's end)
    sent = await proxied(proxy, Edge([s]))
    assert sent[0]["status"] == 200
    assert (pool.idle("a", 80) == 1) == kept and s.closed != kept
    await pool.close()
