"""E2B's ``lifecycle={"on_timeout": "pause", "auto_resume": True}`` with the pinned, unmodified
``e2b`` SDK on rollbox's ``resume_on_traffic``: at its timeout the sandbox is paused (frozen in
place); traffic to it then resumes it first, once for concurrent requests, and gives it its
timeout again: an envd call (commands, files) and a request through the port proxy (the
per-sandbox origin ``get_host`` names). Without auto_resume, a paused sandbox stays paused.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.conftest import have_image, needs_python
from tests.helpers.e2b_node import e2b_node

e2b = pytest.importorskip("e2b")

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(not have_image("debian:bookworm"), reason="debian:bookworm not built"),
]


async def _paused(edge: Any, sid: str) -> None:
    for _ in range(100):
        if (await edge.get(sid)).state == "paused":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sid} did not pause at its timeout")


async def _resumes(edge: Any, sid: str) -> int:
    return sum(e.kind == "sandbox.resumed" for e in await edge.event_log.read(sid))


async def test_auto_resume_on_envd_call_and_port_traffic() -> None:
    from e2b import AsyncSandbox, SandboxState

    async with e2b_node("e2b-wake", port_domain="ports.test") as (url, key, edge):
        sbx = await AsyncSandbox.create(
            timeout=60, lifecycle={"on_timeout": "pause", "auto_resume": True})
        plain = await AsyncSandbox.create(timeout=60, lifecycle={"on_timeout": "pause"})
        try:
            info = await edge.get(sbx.sandbox_id)
            assert info.resume_on_traffic and info.ttl_s == 60
            assert (await sbx.get_info()).lifecycle["auto_resume"] is True
            await sbx.commands.run("mkdir -p /tmp/srv && echo woke > /tmp/srv/index.html")
            await sbx.commands.run("cd /tmp/srv && python3 -m http.server 8000 "
                                   "--bind 127.0.0.1", background=True)
            await sbx.commands.run("for i in $(seq 100); do python3 -c 'import socket; "
                                   "socket.create_connection((\"127.0.0.1\", 8000))' "
                                   "2>/dev/null && exit 0; sleep 0.1; done; exit 1")
            await sbx.set_timeout(0)
            await plain.set_timeout(0)
            await _paused(edge, sbx.sandbox_id)
            await _paused(edge, plain.sandbox_id)

            # envd calls: five at once, one resume, all served
            outs = await asyncio.gather(*(sbx.commands.run(f"echo {i}") for i in range(5)))
            assert [o.stdout for o in outs] == [f"{i}\n" for i in range(5)]
            assert await _resumes(edge, sbx.sandbox_id) == 1
            after = await edge.get(sbx.sandbox_id)
            assert after.state == "running" and after.expires_at > time.time() + 50
            # a paused sandbox without auto_resume stays paused: envd says "not running"
            assert not await plain.is_running()
            assert (await edge.get(plain.sandbox_id)).state == "paused"

            # the port proxy: paused again, then one request through its origin wakes it
            await sbx.set_timeout(0)
            await _paused(edge, sbx.sandbox_id)
            host = sbx.get_host(8000)
            async with httpx.AsyncClient(timeout=30) as h:
                rs = await asyncio.gather(*(h.get(url + "/index.html", headers={
                    "Host": host, "X-API-Key": key}) for _ in range(4)))
            assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
            assert rs[0].text == "woke\n"
            assert await _resumes(edge, sbx.sandbox_id) == 2
            assert (await sbx.get_info()).state == SandboxState.RUNNING
        finally:
            await asyncio.gather(sbx.kill(), plain.kill(), return_exceptions=True)


@needs_python
async def test_native_resume_on_traffic_through_the_port_proxy() -> None:
    """The same on the native API: ``create(resume_on_traffic=True)``, a plain ``pause()``,
    then a request to ``url(port)`` resumes it and reaches the service that was listening."""
    from rollbox import AsyncClient

    async with e2b_node("e2b-wake-native") as (url, key, edge):
        async with AsyncClient(url, api_key=key) as c:
            sb = await c.create("python:3.11", ttl_s=120, resume_on_traffic=True)
            try:
                assert (await edge.get(sb.id)).resume_on_traffic
                await sb.exec("mkdir -p /tmp/s && echo native > /tmp/s/i.html")
                await sb.exec_background("cd /tmp/s && exec python3 -m http.server 8001 "
                                         "--bind 127.0.0.1")
                up = await sb.exec("for i in $(seq 100); do python3 -c 'import socket; "
                                   "socket.create_connection((\"127.0.0.1\", 8001))' "
                                   "2>/dev/null && exit 0; sleep 0.1; done; exit 1")
                assert up.exit_code == 0
                await sb.set_ttl(5)
                await sb.pause()
                async with httpx.AsyncClient(timeout=30) as h:
                    r = await h.get(sb.url(8001) + "i.html",
                                    headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200 and r.text == "native\n", r.text
                info = await edge.get(sb.id)
                assert info.state == "running" and info.expires_at > time.time() + 100
            finally:
                await sb.delete()
