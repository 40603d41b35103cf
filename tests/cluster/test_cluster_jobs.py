"""Job leases in cluster mode (the session cluster of conftest): the replicas and every edge
actor share the cluster's PostgreSQL lease store. A job opened through replica A lives on
heartbeats sent through replica B, its sandboxes are listed through either replica, and when the
heartbeats stop the reaper of each sandbox's edge ends it (a 0.5 s heartbeat: the lease expires
1.5 s after the last one); the job then reads expired through both replicas."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.sdk import AsyncClient
from tests.conftest import have_image

pytestmark = [pytest.mark.root, pytest.mark.skipif(not have_image("debian:bookworm"),
                                                   reason="debian:bookworm not built")]
IMAGE = "debian:bookworm"
HEARTBEAT_S = 0.5


async def _ended(client: AsyncClient, sandbox_id: str, timeout: float) -> str | None:
    """Wait until the sandbox is no longer running; its dead reason (None if it is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = (await client.get(sandbox_id)).info
        except errors.NotFound:
            return None
        if info.state not in ("creating", "running"):
            return info.dead_reason or info.state
        assert time.monotonic() < deadline, f"{sandbox_id} still {info.state} after {timeout} s"
        await asyncio.sleep(0.2)


async def test_a_job_opened_via_one_replica_lives_on_heartbeats_via_the_other(cluster) -> None:  # noqa: ANN001
    state, _ = cluster
    key = Path(state.admin_key).read_text().strip()
    a_url, b_url = state.replica_urls[:2]
    name = f"job-{uuid.uuid4().hex[:8]}"
    base = f"/v1/jobs/{name}"
    async with AsyncClient(a_url, key) as a, AsyncClient(b_url, key) as b:
        opened = (await a._t.request("POST", "/v1/jobs", json={
            "name": name, "heartbeat_s": HEARTBEAT_S})).json()
        assert opened["state"] == "live"
        made = []
        try:
            for _ in range(2):
                made.append(await a.create(IMAGE, job=name, ttl_s=120))
            # Heartbeats through B only, for longer than a lease (1.5 s): nothing ends.
            last = opened["heartbeat_at"]
            for _ in range(5):
                await asyncio.sleep(HEARTBEAT_S)
                beat = (await b._t.request("POST", base + "/heartbeat")).json()
                assert beat["state"] == "live" and beat["heartbeat_at"] > last
                last = beat["heartbeat_at"]
            for client in (a, b):
                listed = (await client._t.request("GET", base + "/sandboxes")).json()
                assert sorted(i["id"] for i in listed) == sorted(sb.id for sb in made)
                assert (await client._t.request("GET", base)).json()["state"] == "live"
            for sb in made:
                assert (await b.get(sb.id)).info.state == "running"
            # No more heartbeats: the lease expires and each sandbox's edge ends it.
            for sb in made:
                why = await _ended(b, sb.id, 15)
                assert why is None or "heartbeats missed" in why, why
            for client in (a, b):
                job = (await client._t.request("GET", base)).json()
                assert job["state"] == "expired" and "heartbeats missed" in job["reason"]
                assert (await client._t.request("GET", base + "/sandboxes")).json() == []
                with pytest.raises(errors.NotFound):
                    await client._t.request("POST", base + "/heartbeat")
        finally:
            for sb in made:
                with contextlib.suppress(errors.NotFound, errors.SandboxDead):
                    await sb.delete()
            with contextlib.suppress(errors.NotFound):
                await a._t.request("DELETE", base, long=True)
