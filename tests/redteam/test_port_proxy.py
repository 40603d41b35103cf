"""Red-team class 44: the port proxy (rollbox.api.ports) reaching another sandbox, the host or
the control plane, and a port token replayed after its sandbox is gone.

One test per layer, each run twice: against the real stack, where the attack gets nowhere, and
with that one layer removed (monkeypatched here, never reachable through the API), where the
same attack succeeds — so each test can fail.

- the backend: the proxy's socket is made inside the sandbox's netns (backends.ports), so its
  127.0.0.1 is the sandbox's; without it, "port 7420 of the sandbox" is the api's own port and
  a host-only service answers;
- the tokens: a port token's MAC binds the sandbox id and port (api.ports.PortTokens); without
  it, a token of one sandbox opens another's port;
- the ownership check: a key reaches only its project's sandboxes (ApiContext.sandbox_edge),
  also through a per-sandbox origin's Host header; without it, another project's service;
- the edge's service: its port channel needs the cluster token (edge.service.TokenAuth);
  without it, anyone who reaches the edge's port opens any sandbox's ports.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import aiohttp
import httpx
import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.api.context import ApiContext
from rollbox.api.ports import PortConfig, PortTokens
from rollbox.iam import KeyStore
from rollbox.isolation import netns
from tests.conftest import CLUSTER_TOKEN, api_app
from tests.integration.test_ports import start_service

SECRET = b"host-only-secret-7f3a"
DOMAIN = "ports.test"


@contextlib.contextmanager
def host_secret_service() -> Iterator[int]:
    """A service on the host's own 127.0.0.1 (a stand-in for a platform port, e.g. PostgreSQL
    or Ray's): its port."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(SECRET)))
            self.end_headers()
            self.wfile.write(SECRET)

        def log_message(self, *a: object) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.asynccontextmanager
async def api(edge, tmp_path: Path) -> AsyncIterator[tuple[str, KeyStore]]:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    try:
        app = api_app(edge, edge, keys, port_config=PortConfig.ephemeral(DOMAIN))
        async with BackgroundServer(app) as srv:
            yield srv.url, keys
    finally:
        keys.close()


def host_socket(name: str, family: int = socket.AF_INET) -> socket.socket:
    """The removed layer: a socket of the host's own namespace."""
    s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    return s


@pytest.mark.parametrize("hardened", [True, False], ids=["hardened", "netns-layer-removed"])
async def test_c44_host_and_platform_ports_are_never_reached(
        edge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hardened: bool) -> None:  # noqa: ANN001
    if not hardened:
        monkeypatch.setattr(netns, "socket_inside", host_socket)
    with host_secret_service() as host_port:
        async with api(edge, tmp_path) as (url, keys):
            key = keys.create("proj")
            async with rollbox.AsyncClient(url, key) as c:
                sb = await c.create("busybox:test")  # no network, nothing listening
                api_port = int(url.rsplit(":", 1)[1])
                async with httpx.AsyncClient(timeout=30) as h:
                    host = await h.get(sb.url(host_port), headers={"X-API-Key": key})
                    own_api = await h.get(sb.url(api_port) + "v1/health",
                                          headers={"X-API-Key": key})
                    # Host tricks: the origin names only (sandbox, port); a Host of the api or an
                    # address is an api request, never a proxied one.
                    trick = await h.get(url + "/", headers={
                        "Host": f"{host_port}-{sb.id}.{DOMAIN}", "X-API-Key": key})
                if hardened:
                    for r in (host, own_api, trick):
                        assert isinstance(errors.error_from_payload(r.json(), r.status_code),
                                          errors.PortNotListening), r.text
                        assert SECRET not in r.content
                    # ...and the proxy opened no path out for the sandbox: after its traffic the
                    # sandbox still has loopback only and the host's port is not its to reach.
                    res = await sb.exec(["sh", "-c", "awk -F: 'NR>2{print $1}' /proc/net/dev; "
                                         f"nc -w 2 127.0.0.1 {host_port} </dev/null; echo rc=$?"])
                    assert res.stdout.split() == ["lo", "rc=1"], res.stdout
                    assert SECRET.decode() not in res.stdout
                else:  # the attack works without the layer
                    assert host.content == SECRET and trick.content == SECRET
                    assert own_api.status_code == 200 and "ok" in own_api.text.lower()
                await sb.delete()


@pytest.mark.parametrize("hardened", [True, False], ids=["hardened", "token-binding-removed"])
async def test_c44_a_token_opens_its_own_sandbox_and_port_only(
        edge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hardened: bool) -> None:  # noqa: ANN001
    if not hardened:
        monkeypatch.setattr(PortTokens, "verify", lambda self, token, sid, port: None)
    async with api(edge, tmp_path) as (url, keys), \
            rollbox.AsyncClient(url, keys.create("proj")) as c:
        mine = await c.create("busybox:test")
        theirs = await c.create("python:3.11")  # another sandbox with a service
        await start_service(theirs)
        token = (await mine.port_access(8000)).token
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(theirs.url(8000) + "echo", headers={"X-Rollbox-Port-Token": token})
            r2 = await h.get(url + "/echo", headers={"Host": f"8000-{theirs.id}.{DOMAIN}",
                                                     "Cookie": f"rollbox_port_token={token}"})
        if hardened:
            for resp in (r, r2):
                err = errors.error_from_payload(resp.json(), resp.status_code)
                assert isinstance(err, errors.PortTokenInvalid), resp.text
        else:
            assert r.status_code == 200 and r.json()["path"] == "/echo"
            assert r2.status_code == 200
        # Replayed after its sandbox is gone: refused, whatever listens later.
        own = (await theirs.port_access(8000)).token
        await theirs.delete()
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(theirs.url(8000), headers={"X-Rollbox-Port-Token": own})
        assert r.status_code in (404, 410), r.text
        await mine.delete()


@pytest.mark.parametrize("hardened", [True, False], ids=["hardened", "ownership-removed"])
async def test_c44_another_projects_sandbox_is_not_reached(
        edge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hardened: bool) -> None:  # noqa: ANN001
    if not hardened:
        async def any_owner(self: ApiContext, sandbox_id: str, who: object):  # noqa: ANN202
            return self.placement.edge_for(sandbox_id)

        monkeypatch.setattr(ApiContext, "sandbox_edge", any_owner)
    async with api(edge, tmp_path) as (url, keys), \
            rollbox.AsyncClient(url, keys.create("victim")) as c:
        victim = await c.create("python:3.11")
        await start_service(victim)
        attacker = keys.create("attacker")
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(victim.url(8000) + "echo", headers={"X-API-Key": attacker})
            r2 = await h.get(url + "/echo", headers={"Host": f"8000-{victim.id}.{DOMAIN}",
                                                     "Authorization": f"Bearer {attacker}"})
            async with aiohttp.ClientSession() as s:
                try:
                    async with s.ws_connect(victim.url(8000).replace("http", "ws", 1) + "ws",
                                            headers={"X-API-Key": attacker}) as ws:
                        await ws.send_str("in")
                        ws_got = (await ws.receive()).data
                except aiohttp.WSServerHandshakeError as exc:
                    ws_got = exc.status
        if hardened:
            for resp in (r, r2):
                assert isinstance(errors.error_from_payload(resp.json(), resp.status_code),
                                  errors.NotFound), resp.text
            assert ws_got == 404
        else:
            assert r.status_code == 200 and r2.status_code == 200 and ws_got == "in"
        await victim.delete()


@pytest.mark.parametrize("hardened", [True, False], ids=["hardened", "edge-token-removed"])
async def test_c44_the_edges_port_channel_needs_the_cluster_token(
        edge, hardened: bool) -> None:  # noqa: ANN001
    from rollbox.edge import service
    from rollbox.edge.server import BackgroundServer as Srv
    from rollbox.models import SandboxSpec

    app = service.create_edge_app(edge, CLUSTER_TOKEN)
    auth = app.app  # type: ignore[attr-defined]  # below the request-id middleware
    assert isinstance(auth, service.TokenAuth)
    served = app if hardened else auth.app  # TokenAuth's inner app
    info = await edge.create(SandboxSpec(image="python:3.11"))
    await edge.run_shell(info.id, "true", {}, 30)
    async with Srv(served, "127.0.0.1", 0) as srv:
        async with aiohttp.ClientSession() as s:
            try:
                async with s.ws_connect(srv.url + "/edge/v1/port") as ws:  # no token
                    await ws.send_str(f'{{"sandbox_id": "{info.id}", "port": 9}}')
                    got = (await ws.receive()).data
            except aiohttp.WSServerHandshakeError as exc:
                got = exc.status
    if hardened:
        assert got == 403
    else:  # the edge answered for the sandbox (nothing listens on its port 9)
        assert "port_not_listening" in got
    await edge.delete(info.id)
    await asyncio.sleep(0)
