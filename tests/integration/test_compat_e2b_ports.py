"""E2B's ``Sandbox.get_host(port)`` with the pinned, unmodified ``e2b`` SDK: the create answer
carries the api's port domain, and the host it gives (``{port}-{id}.<domain>``) is served by
the api's port proxy (rollbox.api.ports), here reached with that Host header on the api's
address (what a wildcard DNS record does)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import have_image
from tests.helpers.e2b_node import e2b_node

pytest.importorskip("e2b")
pytestmark = pytest.mark.skipif(not have_image("python:3.11"), reason="python:3.11 not built")


async def test_get_host_returns_a_host_that_works() -> None:
    from e2b import AsyncSandbox

    async with e2b_node("e2b-ports", port_domain="ports.test") as (url, key, _):
        sbx = await AsyncSandbox.create("python:3.11", timeout=120)
        try:
            host = sbx.get_host(8000)
            assert host == f"8000-{sbx.sandbox_id}.ports.test"
            await sbx.commands.run("mkdir -p /srv && echo hello-from-e2b > /srv/index.html")
            await sbx.commands.run("cd /srv && python3 -m http.server 8000 --bind 127.0.0.1",
                                   background=True)
            async with httpx.AsyncClient(timeout=30) as h:
                deadline = time.monotonic() + 30
                while True:
                    r = await h.get(url + "/index.html", headers={"Host": host,
                                                                 "X-API-Key": key})
                    if r.status_code != 502 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.3)
                assert r.status_code == 200, r.text
                assert r.text == "hello-from-e2b\n"
                r = await h.get(url + "/index.html", headers={"Host": host})
                assert r.status_code == 401  # the key (or a port token) is needed
        finally:
            await sbx.kill()
