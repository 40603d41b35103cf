"""Pause/resume: the whole sandbox is frozen in its cgroup (processes really stop), exec answers
SandboxPaused, host-side files work, resume continues, deletion and TTL expiry work on a frozen
sandbox, and an edge restart re-adopts a paused sandbox as paused."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.edge.edge import Edge
from rollbox.iam import KeyStore
from rollbox.isolation import cgroups
from rollbox.models import ExecSpec, SandboxSpec
from tests.conftest import BOTH_TRANSPORTS, api_app

BB = "busybox:test"
# A counter written every 20 ms: it advances only while the sandbox's processes run.
COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.02; done"


async def _count(edge: Edge, sid: str) -> int:
    for _ in range(50):  # the loop's `>` truncates before it writes: retry an empty read
        text = (await edge.file_read(sid, "/tmp/count", 64)).strip()
        if text:
            return int(text)
        await asyncio.sleep(0.01)
    raise AssertionError("counter file stays empty")


async def _advancing(edge: Edge, sid: str, timeout: float = 10.0) -> int:
    """Wait until the counter moves; returns its value then."""
    deadline = time.monotonic() + timeout
    first = None
    while time.monotonic() < deadline:
        try:
            now = await _count(edge, sid)
        except errors.NotFound:
            now = None
        if now is not None and first is not None and now > first:
            return now
        first = now if first is None else first
        await asyncio.sleep(0.05)
    raise AssertionError("counter does not advance")


def _cpu_usec(v2: Path) -> int:
    for line in (v2 / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec"):
            return int(line.split()[1])
    raise AssertionError("no usage_usec in cpu.stat")


async def test_pause_freezes_everything_and_resume_continues(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB), "t")
    counter = await edge.exec_start(sb.id, ExecSpec(cmd=COUNTER))
    spinner = await edge.exec_start(sb.id, ExecSpec(cmd="while :; do :; done"))
    await _advancing(edge, sb.id)
    v2 = edge.live[sb.id].box.v2_cgroup

    info = await edge.pause(sb.id)
    assert info.state == "paused" and (await edge.get(sb.id)).state == "paused"
    assert cgroups.is_frozen(v2)
    assert [i.state for i in await edge.list("t", {}) if i.id == sb.id] == ["paused"]
    c1, cpu1 = await _count(edge, sb.id), _cpu_usec(v2)
    await asyncio.sleep(0.6)
    assert await _count(edge, sb.id) == c1  # ~30 increments would have happened
    assert _cpu_usec(v2) - cpu1 < 20_000  # a busy loop would have burnt ~600 ms
    assert (await edge.pause(sb.id)).state == "paused"  # idempotent

    # Nothing can run while paused: a typed error at once, never a hang.
    with pytest.raises(errors.SandboxPaused):
        await asyncio.wait_for(edge.exec_start(sb.id, ExecSpec(cmd="true")), 5)
    with pytest.raises(errors.SandboxPaused):
        await asyncio.wait_for(edge.exec_kill(sb.id, spinner, 9), 5)
    # Host-side operations work on the frozen tree.
    await edge.file_write(sb.id, "/tmp/while-paused", b"hello", 0o644)
    assert await edge.file_read(sb.id, "/tmp/while-paused", 64) == b"hello"
    expires = (await edge.set_ttl(sb.id, 600)).expires_at
    assert expires > time.time() + 500 and (await edge.get(sb.id)).state == "paused"
    assert {e.exec_id for e in await edge.exec_list(sb.id) if e.state == "running"} == {
        counter, spinner}

    info = await edge.resume(sb.id)
    assert info.state == "running" and not cgroups.is_frozen(v2)
    assert (await edge.resume(sb.id)).state == "running"  # idempotent
    assert await _advancing(edge, sb.id) > c1  # the same process continues
    eid = await edge.exec_start(sb.id, ExecSpec(cmd="cat /tmp/while-paused"))
    assert (await edge.exec_wait(sb.id, eid)).stdout == "hello"
    await edge.exec_kill(sb.id, spinner, 9)
    assert (await edge.exec_wait(sb.id, spinner)).signal == 9
    kinds = [e.kind for e in await edge.event_log.read(sb.id, 0)]
    assert kinds.count("sandbox.paused") == 1 and kinds.count("sandbox.resumed") == 1
    await edge.delete(sb.id)
    assert edge.leftovers(sb.id) == []


async def test_delete_and_ttl_expiry_of_paused_sandboxes(edge) -> None:  # noqa: ANN001
    a = await edge.create(SandboxSpec(image=BB), "t")
    b = await edge.create(SandboxSpec(image=BB, ttl_s=600), "t")
    for sid in (a.id, b.id):
        await edge.exec_start(sid, ExecSpec(cmd="sleep 300 & sleep 300"))
        await edge.pause(sid)
    # cgroup.kill reaches frozen tasks: delete of a paused sandbox neither hangs nor leaks.
    await asyncio.wait_for(edge.delete(a.id), 30)
    assert (await edge.get(a.id)).state == "deleted" and edge.leftovers(a.id) == []
    with pytest.raises(errors.SandboxDead):
        await edge.pause(a.id)
    with pytest.raises(errors.SandboxDead):
        await edge.resume(a.id)
    # A paused sandbox's TTL keeps counting: expiry tears it down.
    await edge.set_ttl(b.id, 0.5)
    await edge.wait_deleted(b.id, timeout=15)
    info = await edge.get(b.id)
    assert info.state == "deleted" and info.dead_reason == "ttl expired"
    assert edge.leftovers(b.id) == []


async def test_on_expiry_pause_pauses_at_the_ttl_then_deletes_at_the_paused_ttl(
        edge) -> None:  # noqa: ANN001
    """on_expiry "pause": the TTL's end freezes it (the process stops where it is) and gives it
    paused_ttl_s more; resumed with a new TTL it goes on; paused past that deadline: deleted.
    A bad on_expiry is refused before anything is made."""
    with pytest.raises(Exception, match="on_expiry"):  # pydantic's ValidationError
        SandboxSpec(image=BB, on_expiry="sleep")  # type: ignore[arg-type]
    sb = await edge.create(SandboxSpec(image=BB, ttl_s=600, on_expiry="pause"), "t")
    try:
        assert sb.on_expiry == "pause"
        await edge.exec_start(sb.id, ExecSpec(cmd=COUNTER))
        await _advancing(edge, sb.id)
        await edge.set_ttl(sb.id, 0.5)
        for _ in range(100):
            if (await edge.get(sb.id)).state == "paused":
                break
            await asyncio.sleep(0.1)
        info = await edge.get(sb.id)
        assert info.state == "paused", info.state
        assert info.expires_at > time.time() + edge.settings.paused_ttl_s - 60
        frozen = await _count(edge, sb.id)
        await asyncio.sleep(0.4)
        assert await _count(edge, sb.id) == frozen
        await edge.resume(sb.id)
        await edge.set_ttl(sb.id, 600)
        assert await _advancing(edge, sb.id) > frozen
        await edge.pause(sb.id)  # paused past its deadline: the usual end
        await edge.set_ttl(sb.id, 0.5)
        await edge.wait_deleted(sb.id, timeout=15)
        assert (await edge.get(sb.id)).dead_reason == "ttl expired"
        assert edge.leftovers(sb.id) == []
    finally:
        if sb.id in edge.live:
            await edge.delete(sb.id)


async def test_unknown_sandbox(edge) -> None:  # noqa: ANN001
    ghost = f"{edge.node_id}-0123456789ab"
    with pytest.raises(errors.NotFound):
        await edge.pause(ghost)
    with pytest.raises(errors.NotFound):
        await edge.resume(ghost)


async def test_command_deadline_does_not_fire_while_paused(edge) -> None:  # noqa: ANN001
    """Deadlines are wall-clock: nothing is killed while frozen; a command whose deadline
    passed during the pause ends as timed out right after resume."""
    sb = await edge.create(SandboxSpec(image=BB), "t")
    eid = await edge.exec_start(sb.id, ExecSpec(cmd="sleep 30", timeout_s=0.5))
    await edge.pause(sb.id)
    await asyncio.sleep(0.5 + 2.5)  # past the deadline and the host backstop's grace
    assert not edge.live[sb.id].sessions[eid].done.is_set()
    live = edge.live[sb.id]
    assert cgroups.procs(live.box.v2_cgroup / live.sessions[eid].cgroup_name)  # alive, frozen
    await edge.resume(sb.id)
    result = await asyncio.wait_for(edge.exec_wait(sb.id, eid), 10)
    assert result.timed_out
    await edge.delete(sb.id)


async def test_restart_readopts_paused_sandbox(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    paused = await e1.create(SandboxSpec(image=BB), "t")
    running = await e1.create(SandboxSpec(image=BB), "t")
    for sid in (paused.id, running.id):
        await e1.exec_start(sid, ExecSpec(cmd=COUNTER))
        await _advancing(e1, sid)
    await e1.pause(paused.id)
    # `running` is left frozen behind the journal's back (an edge crash in the middle of a
    # snapshot): the journal's state wins at re-adoption.
    cgroups.freeze(e1.live[running.id].box.v2_cgroup)
    await restarts.stop()  # sandboxes outlive the edge

    e2 = await restarts.start()
    assert (await e2.get(paused.id)).state == "paused"
    assert (await e2.get(running.id)).state == "running"
    assert not cgroups.is_frozen(e2.live[running.id].box.v2_cgroup)
    await _advancing(e2, running.id)
    v2 = e2.live[paused.id].box.v2_cgroup
    assert cgroups.is_frozen(v2)
    c1 = await _count(e2, paused.id)
    await asyncio.sleep(0.4)
    assert await _count(e2, paused.id) == c1
    with pytest.raises(errors.SandboxPaused):
        await e2.exec_start(paused.id, ExecSpec(cmd="true"))
    await e2.resume(paused.id)
    assert await _advancing(e2, paused.id) > c1  # the pre-restart process goes on
    eid = await e2.exec_start(paused.id, ExecSpec(cmd="echo ok"))
    assert (await e2.exec_wait(paused.id, eid)).stdout == "ok\n"
    for sid in (paused.id, running.id):
        await e2.delete(sid)
        assert e2.leftovers(sid) == []


@BOTH_TRANSPORTS
async def test_pause_resume_through_api_and_sdk(edge, api_edge, tmp_path: Path) -> None:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    key = keys.create("proj")
    app = api_app(api_edge, edge, keys)
    try:
        async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
            sb = await c.create(BB)
            assert (await sb.pause()).state == "paused"
            assert sb.info.state == "paused"
            with pytest.raises(rollbox.SandboxPaused):
                await sb.exec("true")
            await sb.files.write("/tmp/x", "y")
            other = await c.create(BB)
            assert [s.id for s in await c.list(state="paused")] == [sb.id]
            assert [s.id for s in await c.list(state=["running"])] == [other.id]
            with pytest.raises(errors.BadRequest):
                await c.list(state="sleeping")
            await other.delete()
            assert (await sb.resume()).state == "running"
            assert (await sb.exec("cat /tmp/x")).stdout == "y"
            await sb.delete()
            with pytest.raises(errors.SandboxDead):
                await sb.pause()
            with pytest.raises(errors.NotFound):
                await c._t.request("POST", f"/v1/sandboxes/{edge.node_id}-0123456789ab/pause")
    finally:
        keys.close()


async def test_snapshot_of_paused_sandbox_keeps_it_paused(edge) -> None:  # noqa: ANN001
    """A snapshot of a paused sandbox copies the frozen tree and leaves it frozen (the snapshot's
    own freeze/thaw must not resume it); pause/resume during a snapshot is refused."""
    import secrets

    from rollbox.models import SnapshotSpec

    sb = await edge.create(SandboxSpec(image=BB), "t")
    await edge.exec_start(sb.id, ExecSpec(cmd=COUNTER))
    await _advancing(edge, sb.id)
    await edge.pause(sb.id)
    await edge.file_write(sb.id, "/root/mark", b"paused\n", 0o644)  # /tmp is scrubbed
    name = f"test/paused-{secrets.token_hex(4)}:1"
    try:
        snap_task = asyncio.create_task(edge.snapshot(sb.id, SnapshotSpec(name=name), "t"))
        for _ in range(500):  # wait until the snapshot has started
            if sb.id in edge._snapshotting or snap_task.done():
                break
            await asyncio.sleep(0.001)
        if not snap_task.done():
            with pytest.raises(errors.BadRequest):
                await edge.resume(sb.id)
        res = await snap_task
        assert res.image == name
        v2 = edge.live[sb.id].box.v2_cgroup
        assert (await edge.get(sb.id)).state == "paused" and cgroups.is_frozen(v2)
        copy = await edge.create(SandboxSpec(image=name), "t")
        eid = await edge.exec_start(copy.id, ExecSpec(cmd="cat /root/mark"))
        assert (await edge.exec_wait(copy.id, eid)).stdout == "paused\n"
        await edge.delete(copy.id)
        await edge.resume(sb.id)
        await _advancing(edge, sb.id)
    finally:
        await edge.delete(sb.id)
        try:
            edge.store.remove(name)
        except errors.NotFound:
            pass
