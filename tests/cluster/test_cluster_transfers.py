"""An api replica killed while a client streams through it (issue 14 item 7, the SDK side):
a file download and a followed event stream, both on the replica that dies, resume on the
other replica at their offsets (the bytes the client has, the last event's seq) and come out
whole, in order, once. One kill on the session's cluster (the replica is started again
after); a tar download broken the same way is downloaded again whole
(tests/integration/test_sdk_failover_replicas.py covers tar and uploads on in-process
replicas)."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from pathlib import Path

import pytest

from rollbox.models import Event
from rollbox.sdk import AsyncClient
from tests.conftest import have_image

pytestmark = [pytest.mark.root, pytest.mark.skipif(not have_image("debian:bookworm"),
                                                   reason="debian:bookworm not built")]
IMAGE = "debian:bookworm"
SIZE_MIB = 48  # far more than the sockets buffer: the kill lands mid-stream


async def test_a_download_and_followed_events_resume_on_the_other_replica(cluster) -> None:  # noqa: ANN001
    from rollbox.cluster import local

    state, s = cluster
    key = Path(state.admin_key).read_text().strip()
    async with AsyncClient(state.replica_urls, key) as c:
        sb = await c.create(IMAGE, ttl_s=600)
        rec, deleted = None, False
        try:
            r = await sb.exec(f"head -c {SIZE_MIB}M /dev/urandom > /big && sha256sum /big")
            want = r.stdout.split()[0]
            using = c.base_url
            rec = next(x for x in state.replicas if x.url == using)
            events: list[Event] = []
            first_event = asyncio.Event()

            async def follow() -> None:
                async for ev in sb.stream_events(follow=True):
                    events.append(ev)
                    first_event.set()

            follower = asyncio.create_task(follow())
            await asyncio.wait_for(first_event.wait(), 30)
            digest, got, killed = hashlib.sha256(), 0, False
            async for chunk in sb.files.read_stream("/big"):
                digest.update(chunk)
                got += len(chunk)
                if not killed:  # both streams are on this replica now
                    killed = True
                    os.kill(rec.pid, signal.SIGKILL)
            assert got == SIZE_MIB << 20 and digest.hexdigest() == want
            assert c.base_url != using  # the rest came through the other replica
            after = await sb.exec("echo after the kill")
            assert after.stdout == "after the kill\n"
            await sb.delete()
            deleted = True
            await asyncio.wait_for(follower, 60)  # a followed stream ends with the sandbox
            seqs = [e.seq for e in events]
            assert seqs == sorted(set(seqs)), "an event twice or out of order"
            # Every event of the trail, the ones after the kill included, once.
            trail = await sb.events()
            assert seqs == [e.seq for e in trail][:len(seqs)]
            assert [e.kind for e in events].count("exec.started") == 2  # before and after
            assert events[-1].kind == "sandbox.deleted"
        finally:
            if not deleted:
                with contextlib.suppress(Exception):
                    await sb.delete()
            if rec is not None:  # the replica comes back (its port again)
                i = state.replicas.index(rec)
                state.replicas[i] = local.start_replica(state, s, i)
                state.save(local.state_path(s))
                await asyncio.to_thread(local.wait_replica, state.replicas[i], s)
