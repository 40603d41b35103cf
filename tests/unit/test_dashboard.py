"""The operator dashboard's server side (``api.dashboard``, ``api.sessions``): sign-in
exchanges a key for a signed HttpOnly, SameSite=Strict cookie (never the key), the cookie reads
the /v1 routes as the key would and can change nothing, a forged, expired or revoked session
is refused, a cross-site sign-in is refused, unknown filters are a BadRequest, another
project's sandboxes and errors are not shown. The page in real chromium:
tests/integration/test_dashboard_browser.py."""
from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from rollbox import errors
from rollbox.api.sessions import Sessions
from rollbox.iam import Principal
from test_api_support import ApiStack


def test_session_tokens() -> None:
    s = Sessions(b"k" * 32, ttl_s=60)
    who = Principal(project="acme", admin=False, key_id="kid1", scope=None)
    tok = s.issue(who)
    assert s.open(tok).principal == who
    body, _, mac = tok.partition(".")
    for bad in (tok + "x", body + ".", "." + mac, "garbage", "", body[:-2] + "AA." + mac):
        with pytest.raises(errors.Unauthorized):
            s.open(bad)
    with pytest.raises(errors.Unauthorized, match="expired"):
        s.open(tok, now=time.time() + 61)
    with pytest.raises(errors.Unauthorized):
        Sessions(b"o" * 32).open(tok)  # another secret


async def login(h: aiohttp.ClientSession, url: str, key: str) -> aiohttp.ClientResponse:
    return await h.post(f"{url}/dashboard/login", data={"key": key}, allow_redirects=False)


async def test_sign_in_read_only_and_isolated(tmp_path: Path) -> None:
    async with ApiStack(tmp_path) as s, s.client(s.key_a) as a, s.client(s.key_b) as b:
        mine = await a.create("busybox:test", labels={"run": "7"})
        theirs = await b.create("busybox:test")
        jar = aiohttp.CookieJar(unsafe=True)  # 127.0.0.1
        async with aiohttp.ClientSession(cookie_jar=jar) as h:
            async with h.get(f"{s.url}/dashboard") as r:
                page = await r.text()
                assert r.status == 200 and 'name="key"' in page  # the sign-in page
                assert "default-src 'none'" in r.headers["Content-Security-Policy"]
            r = await login(h, s.url, "rb_not_a_key")
            assert r.status == 401 and not jar.filter_cookies(s.url)
            r = await h.post(f"{s.url}/dashboard/login", data={"key": s.key_a},
                             headers={"Origin": "https://evil.example"}, allow_redirects=False)
            assert r.status == 403 and not jar.filter_cookies(s.url)
            r = await login(h, s.url, s.key_a)
            assert r.status == 303
            set_cookie = r.headers["Set-Cookie"]
            assert "HttpOnly" in set_cookie and "samesite=strict" in set_cookie.lower()
            assert s.key_a not in set_cookie  # the key is never the cookie
            async with h.get(f"{s.url}/dashboard") as r:
                assert 'id="sandboxes"' in await r.text()  # the page itself now
            async with h.get(f"{s.url}/dashboard/api/sandboxes") as r:
                ids = {x["id"] for x in await r.json()}
            assert mine.id in ids and theirs.id not in ids
            async with h.get(f"{s.url}/dashboard/api/sandboxes",
                             params={"label": "run=7", "backend": "container"}) as r:
                assert [x["id"] for x in await r.json()] == [mine.id]
            async with h.get(f"{s.url}/dashboard/api/sandboxes", params={"backend": "vm"}) as r:
                assert await r.json() == []
            async with h.get(f"{s.url}/dashboard/api/sandboxes", params={"owner": "x"}) as r:
                body = await r.json()
                assert r.status == 400 and "unknown dashboard filter" in body["error"]["message"]
            # the /v1 routes read with the cookie, as the key would
            async with h.get(f"{s.url}/v1/sandboxes/{mine.id}") as r:
                assert r.status == 200
            async with h.get(f"{s.url}/v1/sandboxes/{theirs.id}") as r:
                assert r.status == 404  # another project's looks absent
            # ... and change nothing: no key, no write
            async with h.delete(f"{s.url}/v1/sandboxes/{mine.id}") as r:
                assert r.status == 401
            async with h.post(f"{s.url}/v1/sandboxes", json={"image": "busybox:test"}) as r:
                assert r.status == 401
            assert (await a.get(mine.id)).info.state == "running"
            # errors: this project's, not the other's
            with pytest.raises(errors.NotFound):
                await b.get("n0-ffffffffffff")
            async with h.get(f"{s.url}/v1/sandboxes/n0-000000000000") as r:
                assert r.status == 404
            async with h.get(f"{s.url}/dashboard/api/errors") as r:
                seen = await r.json()
            assert seen and all(e["project"] == "proj-a" for e in seen)
            assert seen[0]["route"] == "/v1/sandboxes/{sandbox_id}" and seen[0]["request_id"]
            # a revoked key's session ends at once
            async with h.get(f"{s.url}/dashboard/api/whoami") as r:
                key_id = (await r.json())["key_id"]
            s.keys.revoke(key_id)
            async with h.get(f"{s.url}/dashboard/api/sandboxes") as r:
                assert r.status == 401
            async with h.get(f"{s.url}/dashboard") as r:
                assert 'name="key"' in await r.text()
        await theirs.delete()


async def test_an_admin_session_sees_every_project(tmp_path: Path) -> None:
    async with ApiStack(tmp_path) as s, s.client(s.key_a) as a, s.client(s.key_b) as b:
        x, y = await a.create("busybox:test"), await b.create("busybox:test")
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as h:
            assert (await login(h, s.url, s.admin_key)).status == 303
            async with h.get(f"{s.url}/dashboard/api/sandboxes") as r:
                ids = {i["id"] for i in await r.json()}
            assert {x.id, y.id} <= ids
            async with h.get(f"{s.url}/dashboard/api/nodes") as r:
                nodes = await r.json()
            assert [n["node"] for n in nodes] == ["n0"] and nodes[0]["health"] == "ok"
            assert nodes[0]["sandboxes"] >= 2
            async with h.get(f"{s.url}/dashboard/api/sandboxes",
                             params={"project": "proj-b"}) as r:
                assert [i["id"] for i in await r.json()] == [y.id]
            async with h.get(f"{s.url}/dashboard/static/app.js") as r:
                assert r.status == 200 and "textContent" in await r.text()
            async with h.get(f"{s.url}/dashboard/static/../dashboard.py") as r:
                assert r.status == 404
            async with h.get(f"{s.url}/dashboard/static/index.html") as r:
                assert r.status == 404  # only the named assets
            assert (await h.post(f"{s.url}/dashboard/logout", allow_redirects=False)).status == 303
            async with h.get(f"{s.url}/dashboard/api/sandboxes") as r:
                assert r.status == 401
