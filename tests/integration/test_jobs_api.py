"""Trainer jobs, keys and image errors through the real stack (SDK -> HTTP API -> edge ->
runc): job leases and their bad input, create_many cancelled mid-way, an edge restart that
keeps a live job's sandboxes, key listing and revocation, unknown-image errors that name only
what the caller may see."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

import rollbox
from rollbox import errors
from rollbox.models import JobSpec, SandboxSpec
from tests.conftest import new_name

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root and runc")]
BB = "busybox:test"


async def test_job_lease_lifecycle_and_bad_input(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj-a")) as a, \
            rollbox.AsyncClient(url, keys.create("proj-b")) as b:
        job = await a.job("run-42", heartbeat_s=5).open()
        assert job.info is not None and job.info.state == "live"
        sbs = await job.create_many(2, BB)
        loose = await a.create(BB)  # not in the job
        assert {s.info.job for s in sbs} == {"run-42"}
        assert sorted(s.id for s in await job.list()) == sorted(s.id for s in sbs)
        assert sorted(s.id for s in await a.list(job="run-42")) == sorted(s.id for s in sbs)
        # Re-opening the live name resumes the same job (its sandboxes stay in it).
        again = await a.job("run-42", heartbeat_s=5).open()
        assert again.info is not None and again.info.created_at == job.info.created_at
        assert len(await again.list()) == 2
        await again.end()  # stops only its own heartbeat thread... and ends the job

        # Another project: the same name is not its job, and nothing says it exists.
        for call in (lambda: b.create(BB, job="run-42"),
                     lambda: b._t.request("POST", "/v1/jobs/run-42/heartbeat"),
                     lambda: b._t.request("GET", "/v1/jobs/run-42/sandboxes"),
                     lambda: b._t.request("DELETE", "/v1/jobs/run-42"),
                     lambda: b._t.request("GET", "/v1/jobs/run-42?project=proj-a")):
            with pytest.raises(errors.NotFound) as err:
                await call()
            assert "proj-a" not in err.value.message
        assert await b.list(job="run-42") == [] and await b.jobs() == []
        with pytest.raises(errors.BadRequest):
            a.job("bad/name")
        with pytest.raises(errors.BadRequest):
            a.job("ok", heartbeat_s=0.01)
        with pytest.raises(errors.BadRequest):
            a.job("ok", heartbeat_s=10_000)
        for body in ({"name": "a b"}, {"name": "ok", "heartbeat_s": 0}, {"name": "ok", "x": 1},
                     {"name": "ok", "heartbeat_s": 1e9}):
            with pytest.raises(errors.BadRequest):
                await a._t.request("POST", "/v1/jobs", json=body)
        with pytest.raises(errors.BadRequest):
            await a._t.request("POST", "/v1/jobs/bad%20name/heartbeat")
        with pytest.raises(errors.NotFound):  # no such job: nothing is created
            await a.create(BB, job="no-such-job")
        with pytest.raises(errors.BadRequest):
            await a.create(BB, job="bad/name")

        # The job ended (above): its sandboxes are gone, the loose one stays, no more creates.
        assert all(sb.id not in edge.live for sb in sbs)
        assert loose.id in edge.live
        with pytest.raises(errors.NotFound):
            await job.create(BB)
        with pytest.raises(errors.NotFound):
            await job.end()
        evs = await sbs[0].events()
        assert any(e.kind == "sandbox.job_ended" and "run-42" in e.data for e in evs)
        await job.__aexit__(None, None, None)  # leaving an ended job's block is quiet
        await asyncio.sleep(0.3)  # a reaper sweep: the lease state is all it goes by
        assert loose.id in edge.live
        await loose.delete()
        assert [j.state for j in await a.jobs()] == ["ended"]


async def test_create_many_cancelled_leaves_nothing(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj")) as c:
        task = asyncio.ensure_future(c.create_many(16, BB, concurrency=4))
        deadline = time.monotonic() + 30
        while not edge.live and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert edge.live and not task.done()  # cancelled mid-way: some exist, some not yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await c.list() == [] and not edge.live


async def test_edge_restart_keeps_a_live_jobs_sandboxes(restarts) -> None:
    """The edge was down longer than 3 heartbeats: its restart gives the trainer 3 more
    before the job's sandboxes go; then, without heartbeats, they go."""
    e1 = await restarts.start()
    await e1.leases.open("p", JobSpec(name="j", heartbeat_s=0.5))
    sb = await e1.create(SandboxSpec(image=BB, job="j"), "p")
    await restarts.stop()
    await asyncio.sleep(2.0)  # down for 4 heartbeats
    e2 = await restarts.start()
    assert (await e2.leases.get("p", "j")).state == "live"
    for _ in range(4):  # the trainer's heartbeats get through again
        await asyncio.sleep(0.5)
        await e2.leases.heartbeat("p", "j")
    assert (await e2.get(sb.id)).state == "running"
    await asyncio.sleep(1.5 + 0.3 + 0.5)  # 3 missed + a sweep + slack
    await e2.wait_deleted(sb.id, 10)
    info = await e2.get(sb.id)
    assert info.state == "deleted" and "heartbeats missed" in (info.dead_reason or "")
    assert (await e2.leases.get("p", "j")).state == "expired"
    assert e2.leftovers(sb.id) == []


async def test_keys_listed_and_revoked_at_once(api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    admin_key = keys.create("ops", admin=True)
    key = keys.create("team")
    async with rollbox.AsyncClient(url, admin_key) as admin, \
            rollbox.AsyncClient(url, key) as team:
        assert await team.jobs() == []  # the key works (and is cached by the server)
        listed = await admin.keys()
        assert {k.project for k in listed} == {"ops", "team"}
        assert all(key[12:] not in k.model_dump_json() for k in listed)
        mine = [k for k in await admin.keys(project="team")]
        assert len(mine) == 1 and mine[0].last_used_at is not None
        with pytest.raises(errors.Forbidden):
            await team.keys()
        with pytest.raises(errors.Forbidden):
            await team.revoke_key(mine[0].key_id)
        await admin.revoke_key(mine[0].key_id)
        with pytest.raises(errors.Unauthorized):
            await team.jobs()
        with pytest.raises(errors.NotFound):
            await admin.revoke_key(mine[0].key_id)
        with pytest.raises(errors.NotFound):
            await admin.revoke_key("key_nope")
        assert (await admin.keys(project="team"))[0].revoked_at is not None


async def test_unknown_image_names_only_what_the_caller_may_see(  # noqa: ANN001
        edge, names: list[str], api_server) -> None:
    secret = new_name(names, "secret-snap")
    bb = edge.store.resolve(BB)
    edge.store.tag(secret, list(bb.layers), {**bb.config, "owner": "proj-a"})
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj-a")) as a, \
            rollbox.AsyncClient(url, keys.create("proj-b")) as b:
        with pytest.raises(errors.NotFound) as seen_by_b:
            await b.create("no-such/image:1")
        with pytest.raises(errors.NotFound) as taken_by_b:
            await b.create(secret)  # another project's image looks absent, the same way
        with pytest.raises(errors.NotFound) as seen_by_a:
            await a.create("no-such/image:1")
        with pytest.raises(errors.NotFound) as layer_by_b:
            await b.create(BB, layers=["sha256-" + "0" * 64])
    for err in (seen_by_b, taken_by_b, layer_by_b):
        msg = err.value.message
        known = msg.split("(known: ")[1]  # the names the message offers
        assert secret not in known and BB in known, msg
        assert str(edge.store.root) not in msg and "/var/lib" not in msg, msg
    known = seen_by_a.value.message.split("(known: ")[1]
    assert secret in known and BB in known
    assert str(edge.store.root) not in seen_by_a.value.message
    assert taken_by_b.value.message.replace(secret, "X") == \
        seen_by_b.value.message.replace("no-such/image:1", "X")  # absent and hidden look alike
