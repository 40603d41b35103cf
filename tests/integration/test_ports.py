"""Exposed ports through the real stack (HTTP client -> api proxy -> edge, in-process or over
the edge's HTTP service -> the sandbox's loopback): both forms, WebSocket upgrades, API key and
port-token auth, typed errors for bad ports, bad tokens and a port nothing listens on, and a
sandbox with no network permission at all (rollbox.api.ports, docs/ports.md)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.api import ports as api_ports
from rollbox.api.ports import PortConfig
from rollbox.iam import KeyStore
from tests.conftest import BOTH_TRANSPORTS, api_app

SERVICE = (Path(__file__).parent.parent / "helpers" / "port_service.py").read_bytes()
DOMAIN = "ports.test"
PORT = 8000


async def start_service(sb: rollbox.AsyncSandbox, host: str = "127.0.0.1",
                        port: int = PORT) -> None:
    """The test service in ``sb`` on host:port, answering before this returns."""
    await sb.files.write("/tmp/port_service.py", SERVICE)
    await sb.exec_background(["python3", "/tmp/port_service.py", host, str(port)])
    deadline = time.monotonic() + 30
    while True:
        res = await sb.exec(["python3", "-c", "import socket; socket.create_connection("
                             f"('127.0.0.1', {port}), 1)"])
        if res.exit_code == 0:
            return
        assert time.monotonic() < deadline, res.stderr
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def node(edge, face, tmp_path: Path) -> AsyncIterator[tuple[str, str, str, KeyStore]]:  # noqa: ANN001
    """(api url, key of "proj", key of "other", keys) of an api with a port domain."""
    keys = KeyStore(tmp_path / "keys.db")
    try:
        app = api_app(face, edge, keys, port_config=PortConfig.ephemeral(DOMAIN))
        async with BackgroundServer(app) as srv:
            yield srv.url, keys.create("proj"), keys.create("other"), keys
    finally:
        keys.close()


def error_of(r: httpx.Response) -> errors.RollboxError:
    return errors.error_from_payload(r.json(), r.status_code)


@BOTH_TRANSPORTS
async def test_http_and_websocket_through_both_forms(edge, api_edge, tmp_path: Path) -> None:  # noqa: ANN001
    async with node(edge, api_edge, tmp_path) as (url, key, other, _), \
            rollbox.AsyncClient(url, key) as c:
        sb = await c.create("python:3.11")  # no network at all
        assert sb.info.network is None
        await start_service(sb)
        base = sb.url(PORT)
        assert base == f"{url}/v1/sandboxes/{sb.id}/ports/{PORT}/"
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=30) as h:
            # The path form with the API key: the service's answer, sandboxed, no cookies.
            r = await h.get(base + "echo?q=1", headers={**auth, "Cookie": "api=secret"})
            assert r.status_code == 200, r.text
            echo = r.json()
            assert echo["path"] == "/echo?q=1"
            assert "authorization" not in echo["headers"] and "cookie" not in echo["headers"]
            assert echo["headers"]["x-forwarded-prefix"] == f"/v1/sandboxes/{sb.id}/ports/{PORT}"
            assert r.headers["content-security-policy"] == "sandbox"
            # Bodies both ways, fixed length and chunked; a chunked answer; HEAD.
            r = await h.post(base + "up", headers=auth, content=b"a" * 100_000)
            assert r.json()["body"] == "a" * 100_000

            async def parts() -> AsyncIterator[bytes]:
                for i in range(3):
                    yield f"c{i}".encode()

            r = await h.put(base + "chunked", headers=auth, content=parts())
            assert r.json()["body"] == "c0c1c2"
            assert (await h.get(base + "stream", headers=auth)).text == "".join(
                f"part{i};" for i in range(5))
            assert len((await h.get(base + "big?n=3000000", headers=auth)).content) == 3_000_000
            r = await h.head(base, headers=auth)
            assert r.status_code == 200 and r.content == b""
            r = await h.get(base + "cookies", headers=auth)
            assert "set-cookie" not in r.headers
            # A redirect is the client's to follow, never the proxy's.
            r = await h.get(base + "redirect?to=http://169.254.169.254/latest/", headers=auth)
            assert r.status_code == 302
            assert r.headers["location"] == "http://169.254.169.254/latest/"

            # Port tokens: a header (never a query string), bound to the sandbox and port.
            access = await sb.port_access(PORT)
            assert access.path == f"/v1/sandboxes/{sb.id}/ports/{PORT}/"
            assert access.host == f"{PORT}-{sb.id}.{DOMAIN}"
            tok = {"X-Rollbox-Port-Token": access.token}
            r = await h.get(base + "echo", headers=tok)
            assert r.status_code == 200 and "x-rollbox-port-token" not in r.json()["headers"]
            r = await h.get(base + f"echo?token={access.token}")
            assert isinstance(error_of(r), errors.Unauthorized)
            other_port = await sb.port_access(PORT + 1)
            r = await h.get(base, headers={"X-Rollbox-Port-Token": other_port.token})
            assert isinstance(error_of(r), errors.PortTokenInvalid)
            assert error_of(r).details["reason"] == "forged"
            forged = access.token[:-2] + ("AA" if not access.token.endswith("AA") else "BB")
            r = await h.get(base, headers={"X-Rollbox-Port-Token": forged})
            assert error_of(r).details["reason"] == "forged"
            short = await sb.port_access(PORT, ttl_s=1)
            await asyncio.sleep(1.1)
            r = await h.get(base, headers={"X-Rollbox-Port-Token": short.token})
            assert isinstance(error_of(r), errors.PortTokenInvalid)
            assert error_of(r).details["reason"] == "expired"

            # Bad input: typed errors.
            for bad in ("0", "65536", "http", "-1"):
                r = await h.get(f"{url}/v1/sandboxes/{sb.id}/ports/{bad}/", headers=auth)
                assert r.status_code == 400 and isinstance(error_of(r), errors.BadRequest), bad
            with pytest.raises(errors.BadRequest):
                sb.url(70000)
            with pytest.raises(errors.BadRequest):
                await sb.port_access(0)
            r = await h.get(sb.url(PORT + 1), headers=auth)
            assert isinstance(error_of(r), errors.PortNotListening), r.text
            r = await h.get(base)
            assert isinstance(error_of(r), errors.Unauthorized)
            r = await h.get(base, headers={"Authorization": f"Bearer {other}"})
            assert isinstance(error_of(r), errors.NotFound)

            # The per-sandbox origin: Host-header routing, a login that sets its cookie.
            origin = {"Host": access.host}
            r = await h.get(url + "/echo", headers={**origin, **auth})
            assert r.status_code == 200 and r.json()["path"] == "/echo"
            assert "content-security-policy" not in r.headers
            r = await h.post(url + "/_rollbox/login", headers=origin,
                             data={"token": access.token})
            assert r.status_code == 303
            cookie = r.headers["set-cookie"]
            assert cookie.startswith(f"rollbox_port_token={access.token};")
            assert "HttpOnly" in cookie and "Domain" not in cookie
            jar = {"Cookie": f"rollbox_port_token={access.token}; app=1"}
            r = await h.get(url + "/cookies", headers={**origin, **jar})
            assert r.status_code == 200
            assert r.headers.get_list("set-cookie") == ["plain=1; Path=/"]  # Domain= dropped
            r = await h.get(url + "/echo", headers={**origin, **jar})
            assert r.json()["headers"]["cookie"] == "app=1"  # ours is not forwarded
            # The cookie works on its own origin only.
            r = await h.get(base, headers=jar)
            assert isinstance(error_of(r), errors.Unauthorized)
            r = await h.get(url + "/", headers={"Host": f"{PORT + 1}-{sb.id}.{DOMAIN}", **jar})
            assert isinstance(error_of(r), errors.PortTokenInvalid)
            r = await h.get(url + "/", headers={"Host": f"bad.{sb.id}.{DOMAIN}", **auth})
            assert isinstance(error_of(r), errors.NotFound)

        # WebSocket upgrades, both forms.
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(base.replace("http", "ws", 1) + "ws", headers=auth,
                                    protocols=["chat"]) as ws:
                assert ws.protocol == "chat"
                await ws.send_str("hello")
                assert (await ws.receive()).data == "hello"
                await ws.send_bytes(b"\0" * 70_000)
                assert (await ws.receive()).data == b"\0" * 70_000
            async with s.ws_connect(url.replace("http", "ws", 1) + "/ws",
                                    headers={**origin, **jar}) as ws:
                await ws.send_str("origin")
                assert (await ws.receive()).data == "origin"
            with pytest.raises(aiohttp.WSServerHandshakeError):
                await s.ws_connect(base.replace("http", "ws", 1) + "ws")

        # Gone: the token is refused, as is the key.
        await sb.delete()
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(base, headers=tok)
            assert isinstance(error_of(r), (errors.NotFound, errors.SandboxDead)), r.text
            r = await h.get(base, headers=auth)
            assert isinstance(error_of(r), (errors.NotFound, errors.SandboxDead)), r.text


@BOTH_TRANSPORTS
async def test_connections_into_a_sandbox_are_kept_alive(edge, api_edge, tmp_path: Path,  # noqa: ANN001
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy reuses its connection to a sandbox's service (the service sees one client
    port), for that sandbox and port only; one the service closes, one idle past IDLE_S and
    those of a deleted sandbox leave the pool; a refused request never reaches one."""
    monkeypatch.setattr(api_ports, "IDLE_S", 3.0)
    keys = KeyStore(tmp_path / "keys.db")
    try:
        app = api_app(api_edge, edge, keys, port_config=PortConfig.ephemeral(DOMAIN))
        pool = app.state.port_pool
        async with BackgroundServer(app) as srv:
            key, other = keys.create("proj"), keys.create("other")
            async with rollbox.AsyncClient(srv.url, key) as c, \
                    httpx.AsyncClient(timeout=30) as h:
                a, b = await c.create("python:3.11"), await c.create("python:3.11")
                for sb, who in ((a, "a"), (b, "b")):
                    await sb.files.write("/tmp/port_service.who", who.encode())
                    await start_service(sb)
                auth = {"Authorization": f"Bearer {key}"}

                async def echo(sb: rollbox.AsyncSandbox, path: str = "echo") -> dict:
                    r = await h.get(sb.url(PORT) + path, headers=auth)
                    assert r.status_code == 200, r.text
                    return r.json()

                first = await echo(a)
                assert first["who"] == "a" and "connection" not in first["headers"]
                assert pool.idle(a.id, PORT) == 1
                assert (await echo(a))["peer"] == first["peer"]  # the same connection
                r = await h.post(a.url(PORT) + "up", headers=auth, content=b"p" * 1000)
                assert r.json()["peer"] == first["peer"] and r.json()["body"] == "p" * 1000
                # another sandbox: its own service on a connection of its own
                assert (await echo(b))["who"] == "b"
                assert pool.idle(a.id, PORT) == 1 and pool.idle(b.id, PORT) == 1
                # refused before any connection is taken: the other project's key
                r = await h.get(a.url(PORT) + "echo", headers={
                    "Authorization": f"Bearer {other}"})
                assert isinstance(error_of(r), errors.NotFound)
                assert pool.idle(a.id, PORT) == 1
                # the service closes it (Connection: close): not kept
                assert (await echo(a, "close"))["peer"] == first["peer"]
                assert pool.idle(a.id, PORT) == 0
                second = await echo(a)
                assert second["peer"] != first["peer"]
                # idle past IDLE_S: closed; the next request opens a new one
                await asyncio.sleep(3.5)
                assert pool.idle(a.id, PORT) == 0
                third = await echo(a)
                assert third["peer"] != second["peer"] and pool.idle(a.id, PORT) == 1
                # concurrent requests: a connection each, all kept
                got = await asyncio.gather(*(echo(a) for _ in range(4)))
                assert {g["who"] for g in got} == {"a"} and pool.idle(a.id, PORT) >= 1
                # deleted: its kept connections leave the pool at once (not at IDLE_S)
                assert (await echo(b))["who"] == "b" and pool.idle(b.id, PORT) == 1
                await a.delete()
                async with asyncio.timeout(2):
                    while pool.idle(a.id, PORT):
                        await asyncio.sleep(0.02)
                assert pool.idle(b.id, PORT) == 1
                await b.delete()
    finally:
        keys.close()


async def test_a_service_on_any_address_with_a_network_policy(edge, tmp_path: Path) -> None:  # noqa: ANN001
    """0.0.0.0 is reached too, and a sandbox with a (default-deny) network link works the same:
    the proxy's socket is outside its cgroup's filters."""
    async with node(edge, edge, tmp_path) as (url, key, _, _k), \
            rollbox.AsyncClient(url, key) as c:
        sb = await c.create("python:3.11", network=[])
        await start_service(sb, "0.0.0.0", 8080)
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(sb.url(8080) + "x", headers={"X-API-Key": key})
            assert r.status_code == 200 and r.json()["path"] == "/x"
        await sb.pause()
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(sb.url(8080), headers={"X-API-Key": key})
            assert isinstance(error_of(r), errors.SandboxPaused)
        await sb.resume()
        await sb.delete()


async def test_the_sync_client_has_url_and_port_access(edge, tmp_path: Path) -> None:  # noqa: ANN001
    """``rollbox.Client`` (its own loop thread; run from a thread here so this test's loop,
    which serves the api, stays free)."""
    async with node(edge, edge, tmp_path) as (url, key, _, _k):
        def sync() -> None:
            with rollbox.Client(url, key) as c:
                sb = c.create("python:3.11")
                try:
                    assert sb.url(PORT) == f"{url}/v1/sandboxes/{sb.id}/ports/{PORT}/"
                    with pytest.raises(errors.BadRequest):
                        sb.url(0)
                    access = sb.port_access(PORT, ttl_s=30)
                    assert access.port == PORT and access.expires_at <= time.time() + 31
                    r = httpx.get(sb.url(PORT), headers={"X-Rollbox-Port-Token": access.token})
                    assert isinstance(error_of(r), errors.PortNotListening)
                finally:
                    sb.delete()

        await asyncio.to_thread(sync)
