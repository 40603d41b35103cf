"""The SDK's fail-over between several API URLs (sdk._failover, sdk._http, sdk._async), through
the transport seam with scripted fake transports (one per URL): which URL each request goes
to, what is sent again after a broken connection and what is not, back-off, sticky order,
exec streams re-attached on another URL at their offsets, typed errors. The real thing (two
uvicorn api servers, one killed mid-stream and mid-create) is
tests/integration/test_sdk_failover_replicas.py."""
from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import rollbox
from rollbox import errors
from rollbox.sdk import ASGITransport, Request
from rollbox.sdk._failover import BlockingFailover, FailoverTransport, parse_urls
from test_api_support import ApiStack

SANDBOX = {"id": "n1-abc", "node": "n1", "image": "debian", "layers": [], "state": "running",
           "created_at": 1.0, "expires_at": 2.0, "labels": {},
           "resources": {"cpus": 1, "memory_mib": 512, "disk_mib": 1024}, "owner": "p"}


class FakeResponse:
    def __init__(self, status: int, parts: list[bytes], broken: bool = False) -> None:
        self.status = status
        self.parts = parts
        self.broken = broken  # ConnectionLost after the parts
        self.closed = False

    async def read(self) -> bytes:
        if self.broken:
            raise errors.ConnectionLost("fake: broke while reading")
        return b"".join(self.parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.broken:
            raise errors.ConnectionLost("fake: stream broken")

    async def aclose(self) -> None:
        self.closed = True


Script = Callable[[Request], FakeResponse]


class FakeTransport:
    """One URL: ``down`` refuses (ServerUnreachable) before the app, ``lose`` breaks the
    connection after the request reached it (ConnectionLost), else ``script`` answers."""

    def __init__(self, base_url: str, script: Script | None = None) -> None:
        self.base_url = base_url
        self.script = script or (lambda r: FakeResponse(200, [b"{}"]))
        self.down = False
        self.lose = 0  # this many next requests reach the app, then break
        self.dies = False  # down after a broken one (a killed server)
        self.attempts: list[Request] = []  # every handle() (a connect attempt)
        self.reached: list[Request] = []  # those that reached the app
        self.closed = False

    async def handle(self, request: Request) -> FakeResponse:
        self.attempts.append(request)
        if self.down:
            raise errors.ServerUnreachable(f"fake {self.base_url}: refused")
        self.reached.append(request)
        if self.lose:
            self.lose -= 1
            self.down = self.dies
            raise errors.ConnectionLost(f"fake {self.base_url}: reset after sending")
        return self.script(request)

    def blocking(self, timeout_s: float) -> FakeBlocking:
        return FakeBlocking(self)

    async def aclose(self) -> None:
        self.closed = True


class FakeBlocking:
    def __init__(self, t: FakeTransport) -> None:
        self.t = t
        self.sent = 0

    def handle(self, request: Request) -> tuple[int, bytes]:
        if self.t.down:
            raise errors.ServerUnreachable("fake: refused")
        self.sent += 1
        return 200, b"{}"

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def client_of(*ts: FakeTransport, **kw: Any) -> rollbox.AsyncClient:
    return rollbox.AsyncClient(transport=list(ts), api_key="k", **kw)


def pool(c: rollbox.AsyncClient) -> FailoverTransport:
    t = c._t.transport
    assert isinstance(t, FailoverTransport)
    return t


# ---- construction -----------------------------------------------------------------------
@pytest.mark.parametrize("bad", [[], "", ",", " , ", "ftp://h:1", "http://", "h:7420",
                                 "http://h:99999", "http://h:1/?q=1", "http://u:p@h:1",
                                 "http://h:1#f", "http://h :1", "http://a:1,http://a:1/",
                                 ["http://a:1", 7]])
async def test_bad_url_lists_are_bad_requests_at_construction(bad: Any) -> None:
    with pytest.raises(errors.BadRequest):
        if bad in ("", ","):  # a str: the parser itself (the client reads "" as "the default")
            parse_urls(bad)
        else:
            rollbox.AsyncClient(bad, "k")
    with pytest.raises(errors.BadRequest):
        rollbox.AsyncClient(transport=[], api_key="k")


def test_urls_as_a_list_a_comma_string_or_rollbox_url(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_urls(" http://a:1 ,http://b:2/api, ") == ["http://a:1", "http://b:2/api"]
    c = rollbox.AsyncClient(["http://a:1", "https://b"], "k")
    assert c.urls == ["http://a:1", "https://b"] and c.base_url == "http://a:1"
    monkeypatch.setenv("ROLLBOX_URL", "http://10.0.0.1:7420,http://10.0.0.2:7420")
    c = rollbox.AsyncClient(api_key="k")
    assert c.urls == ["http://10.0.0.1:7420", "http://10.0.0.2:7420"]
    assert isinstance(c._t.transport, FailoverTransport)
    with rollbox.Client(api_key="k") as s:  # the sync face takes the same
        assert s.urls == c.urls and s.base_url == "http://10.0.0.1:7420"
    monkeypatch.setenv("ROLLBOX_URL", "http://10.0.0.1:7420,nonsense")
    with pytest.raises(errors.BadRequest):
        rollbox.AsyncClient(api_key="k")
    with pytest.raises(errors.BadRequest):
        rollbox.Client(api_key="k")


# ---- unreachable: the next URL at once, back-off, sticky --------------------------------
async def test_a_dead_first_url_costs_one_attempt_and_the_order_sticks() -> None:
    a, b, c = (FakeTransport(f"http://{h}:1") for h in "abc")
    a.down = True
    clock = Clock()
    async with client_of(a, b, c) as client:
        pool(client).clock = clock
        for _ in range(10):
            assert await client.health() == {}
        assert (len(a.attempts), len(b.reached), len(c.attempts)) == (1, 10, 0)
        assert client.base_url == "http://b:1"
        clock.now += 3600  # a's back-off is long over: requests still stay on b
        await client.health()
        assert (len(a.attempts), len(b.reached)) == (1, 11)
        b.down = True  # b dies: c (ready) before a; then c sticks
        await client.health()
        assert (len(b.attempts), len(c.reached), len(a.attempts)) == (12, 1, 1)
        await client.health()
        assert (len(b.attempts), len(c.reached), client.base_url) == (12, 2, "http://c:1")
    assert a.closed and b.closed and c.closed


async def test_urls_in_back_off_are_skipped_until_it_ends_then_doubled() -> None:
    a, b = FakeTransport("http://a:1"), FakeTransport("http://b:1")
    clock = Clock()
    async with client_of(a, b, url_backoff_s=2.0) as client:
        p = pool(client)
        p.clock = clock
        a.down = True
        await client.health()  # a fails (back-off 2 s), b answers
        clock.now += 0.5
        b.lose = 1  # b breaks off a read: it goes into back-off, a is still in its own
        await client.health()  # sent again: a is tried (every URL resting), refused...
        assert (len(a.attempts), len(b.reached)) == (2, 3)  # ...then b answers
        assert p.places[0].failures == 2 and p.places[0].dead_until == clock.now + 4.0
        assert client.base_url == "http://b:1"
        b.down = True
        clock.now += 1.0  # both resting: both tried, soonest out of back-off first
        with pytest.raises(errors.ServerUnreachable) as exc:
            await client.health()
        assert [r.target for r in a.attempts + b.attempts][-2:] == ["/v1/health"] * 2
        assert exc.value.details["tried"] == 2 and "none of the 2 API URLs" in exc.value.message
        assert exc.value.retryable


async def test_all_urls_dead_is_server_unreachable_naming_how_many() -> None:
    ts = [FakeTransport(f"http://h{i}:1") for i in range(3)]
    for t in ts:
        t.down = True
    async with client_of(*ts) as client:
        with pytest.raises(errors.ServerUnreachable) as exc:
            await client.list()
        assert exc.value.details == {"tried": 3, "urls": [t.base_url for t in ts]}
        assert [len(t.attempts) for t in ts] == [1, 1, 1]
        sb_like = rollbox.AsyncSandbox(client, rollbox.models.SandboxInfo(**SANDBOX))
        client.reconnect_s = 0.3  # an exec keeps trying for the window, then says so
        with pytest.raises(errors.ServerUnreachable) as exc:
            await sb_like.exec("true")
        assert exc.value.details["tried"] == 3


# ---- broken connections: sent again only when safe --------------------------------------
async def test_a_broken_read_goes_to_the_next_url_an_unsafe_write_does_not() -> None:
    a = FakeTransport("http://a:1", lambda r: FakeResponse(200, [json.dumps(SANDBOX).encode()]))
    b = FakeTransport("http://b:1", lambda r: FakeResponse(200, [json.dumps(SANDBOX).encode()]))
    async with client_of(a, b) as client:
        a.lose = 1
        sb = await client.get("n1-abc")  # GET: sent again on b
        assert sb.id == "n1-abc" and (len(a.reached), len(b.reached)) == (1, 1)
        assert b.reached[0].headers is not None
        assert b.reached[0].headers["X-Rollbox-Attempt"] == "2"
        b.lose = 1
        with pytest.raises(errors.ConnectionLost):
            await sb.set_ttl(60)  # a POST without a key: may have run, never sent twice
        assert (len(a.reached), len(b.reached)) == (1, 2)
        a.lose = b.lose = 1
        with pytest.raises(errors.ConnectionLost):  # every URL broke: at most once per URL
            await sb.refresh()
        assert (len(a.reached), len(b.reached)) == (2, 3)


async def test_a_create_is_sent_again_with_its_key_and_never_reported_unreachable() -> None:
    a = FakeTransport("http://a:1", lambda r: FakeResponse(201, [json.dumps(SANDBOX).encode()]))
    b = FakeTransport("http://b:1", lambda r: FakeResponse(201, [json.dumps(SANDBOX).encode()]))
    async with client_of(a, b) as client:
        a.lose = 1
        sb = await client.create("debian", idempotency_key="create-1")
        assert sb.id == "n1-abc"
        bodies = [json.loads(r.body) for r in a.reached + b.reached]  # type: ignore[arg-type]
        assert [x["idempotency_key"] for x in bodies] == ["create-1", "create-1"]
        assert "X-Rollbox-Attempt" not in (a.reached[0].headers or {})
        assert (b.reached[0].headers or {})["X-Rollbox-Attempt"] == "2"
        await client.create("debian")  # a fresh key per call
        await client.create("debian")
        keys = [json.loads(r.body)["idempotency_key"]  # type: ignore[arg-type]
                for r in b.reached[1:]]
        assert len(set(keys)) == 2 and all(k.startswith("sdk-") for k in keys)
        # broke on b (killed), then a refuses: it may have been made: not ServerUnreachable
        a.down, b.lose, b.dies = True, 1, True
        with pytest.raises(errors.ConnectionLost) as exc:
            await client.create("debian")
        assert not isinstance(exc.value, errors.ServerUnreachable)
        with pytest.raises(errors.BadRequest):
            await client.create("debian", idempotency_key="x" * 129)


def _line(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def _out(offset: int, data: bytes) -> bytes:
    return _line({"type": "stdout", "offset": offset, "data": base64.b64encode(data).decode()})


EXIT = _line({"type": "exit", "result": {"exec_id": "e1", "exit_code": 0, "duration_s": 1.0}})


async def test_an_exec_stream_broken_mid_way_reattaches_on_the_next_url_at_its_offset() -> None:
    text = b"".join(f"{i}\n".encode() for i in range(1, 201))
    cut = len(b"".join(f"{i}\n".encode() for i in range(1, 101)))

    def first(r: Request) -> FakeResponse:  # started, half the output, then the reset
        assert r.method == "POST"
        return FakeResponse(200, [_line({"type": "started", "exec_id": "e1"}),
                                  _out(0, text[:cut])], broken=True)

    def second(r: Request) -> FakeResponse:
        assert r.method == "GET" and r.target.endswith("/exec/e1/stream")
        have = dict(r.params or [])["stdout_offset"]
        start = int(have) - 7  # replays a little before the offset: trimmed by the client
        return FakeResponse(200, [_line({"type": "started", "exec_id": "e1"}),
                                  _out(start, text[start:]), EXIT])

    a, b = FakeTransport("http://a:1", first), FakeTransport("http://b:1", second)
    async with client_of(a, b) as client:
        sb = rollbox.AsyncSandbox(client, rollbox.models.SandboxInfo(**SANDBOX))
        got: list[str] = []
        r = await sb.exec("for i in $(seq 1 200); do echo $i; done", on_stdout=got.append)
        assert r.exit_code == 0 and "".join(got).encode() == text  # all, in order, once
        assert dict(b.reached[0].params or [])["stdout_offset"] == str(cut)
        assert (len(a.reached), len(b.reached), client.base_url) == (1, 1, "http://b:1")


async def test_an_exec_start_broken_before_started_is_sent_again_with_its_key() -> None:
    def second(r: Request) -> FakeResponse:
        assert r.method == "POST"
        return FakeResponse(200, [_line({"type": "started", "exec_id": "e1"}), _out(0, b"x\n"),
                                  EXIT])

    a, b = FakeTransport("http://a:1"), FakeTransport("http://b:1", second)
    a.lose = 1
    async with client_of(a, b) as client:
        sb = rollbox.AsyncSandbox(client, rollbox.models.SandboxInfo(**SANDBOX))
        got: list[str] = []
        await sb.exec("echo x", on_stdout=got.append, idempotency_key="once")
        assert got == ["x\n"]
        keys = [json.loads(r.body)["idempotency_key"]  # type: ignore[arg-type]
                for r in a.reached + b.reached]
        assert keys == ["once", "once"]


def test_the_blocking_face_fails_over_too() -> None:
    a, b = FakeTransport("http://a:1"), FakeTransport("http://b:1")
    ch = FailoverTransport([a, b]).blocking(1.0)
    assert isinstance(ch, BlockingFailover)
    a.down = True
    beat = Request("POST", "/v1/jobs/j/heartbeat", body=b"")
    assert ch.handle(beat) == (200, b"{}") and ch.handle(beat) == (200, b"{}")
    assert [c.sent for c in ch.channels] == [0, 2]  # type: ignore[attr-defined]
    b.down = True
    with pytest.raises(errors.ServerUnreachable) as exc:
        ch.handle(beat)
    assert exc.value.details["tried"] == 2


class LosesAfterSending:
    """An in-process api replica (ASGI) whose connections break once the app has answered
    ``lose`` requests (the answers never reach the client)."""

    def __init__(self, inner: ASGITransport, lose: int) -> None:
        self.inner = inner
        self.base_url = "http://replica-1"
        self.lose = lose

    async def handle(self, request: Request) -> Any:
        resp = await self.inner.handle(request)
        if not self.lose:
            return resp
        self.lose -= 1
        await resp.read()
        await resp.aclose()
        raise errors.ConnectionLost("fake: reset after the app answered")

    def blocking(self, timeout_s: float) -> Any:
        return self.inner.blocking(timeout_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_create_sent_again_through_another_replica_finds_it_on_its_node(
        tmp_path: Path) -> None:
    """Two replicas of one api over two nodes (FakeEdges): the first attempt's sandbox is on
    one node, the retry's placement would pick the other (emptier) one; the api asks every
    node for the key first (X-Rollbox-Attempt > 1), so there is one sandbox."""
    async with ApiStack(tmp_path, nodes=("n0", "n1"), serve=False) as stack:
        one = LosesAfterSending(ASGITransport(stack.app, lifespan=False), lose=1)
        two = ASGITransport(stack.app, lifespan=False)
        async with rollbox.AsyncClient(transport=[one, two], api_key=stack.key_a) as client:
            sb = await client.create("debian")
            made = [i for e in stack.edges for i in await e.list(None, {})]
            assert [i.id for i in made] == [sb.id] and sb.info.idempotency_key
            # control: without the attempt header, another create with the key on the
            # emptier node is another sandbox (what the look-up prevents)
            r = await client._t.request("POST", "/v1/sandboxes", json={
                "image": "debian", "idempotency_key": sb.info.idempotency_key})
            assert r.json()["id"] != sb.id and r.json()["node"] != sb.info.node


async def test_create_many_keeps_each_sandboxs_key_over_its_attempts() -> None:
    """An attempt of create_many broken after the server made the sandbox is tried again
    (ConnectionLost is retryable) with the same key: the server's dedupe makes it that
    sandbox, not a second one outside the returned list."""
    def made(r: Request) -> FakeResponse:
        key = json.loads(r.body)["idempotency_key"]  # type: ignore[arg-type]
        return FakeResponse(201, [json.dumps({**SANDBOX, "id": f"n1-{key}"}).encode()])

    a = FakeTransport("http://a:1", made)
    a.lose = 1  # the first create reaches the app, its answer is lost
    async with client_of(a) as client:
        sbs = await client.create_many(2, "debian", concurrency=1, backoff_s=0.001,
                                       idempotency_key="grp")
    keys = [json.loads(r.body)["idempotency_key"] for r in a.reached]  # type: ignore[arg-type]
    assert len(keys) == 3 and sorted(set(keys)) == ["grp-0", "grp-1"]
    assert keys.count(keys[0]) == 2 and sorted(sb.id for sb in sbs) == ["n1-grp-0", "n1-grp-1"]
