"""Filesystem-only pause (pause(keep_memory=False)) of container sandboxes: every process is
stopped and its cgroup (memory, CPU) and netns are gone, the files written before survive, the
boot id changes at the resume's boot, exec works after it; journaled across an edge restart;
delete of a stopped sandbox tears everything down; bad input is typed. And each boot's own,
read-only boot id (differs between sandboxes and between boots of one)."""
from __future__ import annotations

import asyncio
import time

import pytest

from rollbox import errors
from rollbox.edge.edge import PAUSED_FS_FDS, Edge
from rollbox.isolation import cgroups, netns
from rollbox.models import ExecSpec, NetworkPolicy, SandboxSpec
from tests.conftest import BOTH_TRANSPORTS, api_app

BB = "busybox:test"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
HOST_BOOT_ID = open(BOOT_ID).read().strip()


def box_fds(edge: Edge, networked: bool) -> int:
    return edge.backends["container"].edge_fds(networked)


async def _run(edge: Edge, sid: str, cmd: str) -> tuple[int | None, str]:
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=30))
    r = await asyncio.wait_for(edge.exec_wait(sid, eid), 40)
    return r.exit_code, r.stdout + r.stderr


async def _boot_id(edge: Edge, sid: str) -> str:
    code, out = await _run(edge, sid, f"cat {BOOT_ID}")
    assert code == 0, out
    return out.strip()


async def test_fs_pause_stops_everything_keeps_files_and_reboots(edge: Edge) -> None:
    sb = await edge.create(SandboxSpec(image=BB, network=NetworkPolicy(allow=[])), "t")
    live = edge.live[sb.id]
    box = live.box
    v2 = box.v2_cgroup
    boot1 = await _boot_id(edge, sb.id)
    assert len(boot1) == 36 and boot1 != HOST_BOOT_ID
    await _run(edge, sb.id, "echo kept > /root/marker; echo tmp > /tmp/also")
    sleeper = await edge.exec_start(sb.id, ExecSpec(cmd="sleep 300"))
    mem_before, fds_before = edge.admission.total.memory_mib, edge.admission.fds
    assert live.ticket is not None and live.ticket.fds == box_fds(edge, networked=True)
    assert cgroups.procs(v2)

    info = await edge.pause(sb.id, keep_memory=False)
    assert info.state == "paused" and info.memory_kept is False
    got = await edge.get(sb.id)
    assert got.state == "paused" and got.memory_kept is False
    # Every process is gone, with its cgroup, netns and link: no memory or CPU held.
    assert not v2.exists() and not cgroups.procs(v2)
    assert not netns.netns_path(netns.PREFIX + sb.id).exists()
    assert edge.admission.total.memory_mib == mem_before - sb.resources.memory_mib
    # its channel and network are gone: the edge's descriptors it held count no more
    assert edge.live[sb.id].ticket.fds == PAUSED_FS_FDS
    assert edge.admission.fds == fds_before - box_fds(edge, networked=True) + PAUSED_FS_FDS
    # the command that ran ends with a typed error, recorded
    with pytest.raises(errors.SandboxPaused):
        await asyncio.wait_for(edge.exec_wait(sb.id, sleeper), 10)
    with pytest.raises(errors.SandboxPaused):
        await edge.exec_start(sb.id, ExecSpec(cmd="true"))
    # host-side files still work on the stopped tree
    assert await edge.file_read(sb.id, "/root/marker", 64) == b"kept\n"
    await edge.file_write(sb.id, "/root/while-stopped", b"w\n", 0o644)
    assert (await edge.pause(sb.id, keep_memory=False)).memory_kept is False  # idempotent
    assert (await edge.pause(sb.id)).memory_kept is False  # paused already: a no-op

    info = await edge.resume(sb.id)
    assert info.state == "running" and info.memory_kept is True
    assert edge.admission.total.memory_mib == mem_before
    assert edge.admission.fds == fds_before
    code, out = await _run(edge, sb.id, "cat /root/marker /tmp/also /root/while-stopped; "
                                        "ps -o comm | grep sleep | wc -l")
    assert code == 0 and out.split() == ["kept", "tmp", "w", "0"], out
    boot2 = await _boot_id(edge, sb.id)
    assert boot2 != boot1 and boot2 != HOST_BOOT_ID
    # the network policy came back with the boot (a link in a fresh netns)
    assert netns.netns_path(netns.PREFIX + sb.id).exists() and box.network is not None
    # the boot id is read-only, also for the sandbox's root
    code, out = await _run(edge, sb.id, f"echo x > {BOOT_ID}")
    assert code != 0
    code, out = await _run(edge, sb.id, f"umount {BOOT_ID}")
    assert code != 0
    assert await _boot_id(edge, sb.id) == boot2
    kinds = [e.kind for e in await edge.event_log.read(sb.id, 0)]
    assert kinds.count("sandbox.paused") == 1 and kinds.count("sandbox.resumed") == 1

    # a frozen (memory-kept) pause can be turned into a filesystem-only one
    await edge.pause(sb.id)
    assert cgroups.is_frozen(v2)
    info = await edge.pause(sb.id, keep_memory=False)
    assert info.memory_kept is False and not v2.exists()
    await edge.delete(sb.id)  # delete of a stopped sandbox: verified teardown
    assert (await edge.get(sb.id)).state == "deleted"
    assert edge.leftovers(sb.id) == []


async def test_boot_ids_differ_between_sandboxes(edge: Edge) -> None:
    a = await edge.create(SandboxSpec(image=BB), "t")
    b = await edge.create(SandboxSpec(image=BB), "t")
    ids = {await _boot_id(edge, a.id), await _boot_id(edge, b.id)}
    assert len(ids) == 2 and HOST_BOOT_ID not in ids


async def test_fs_pause_bad_input(edge: Edge) -> None:
    ghost = f"{edge.node_id}-0123456789ab"
    with pytest.raises(errors.NotFound):
        await edge.pause(ghost, keep_memory=False)
    sb = await edge.create(SandboxSpec(image=BB), "t")
    await edge.delete(sb.id)
    with pytest.raises(errors.SandboxDead):
        await edge.pause(sb.id, keep_memory=False)
    # a platform sandbox (a fncall worker) is not paused filesystem-only
    worker = await edge.create(SandboxSpec(image=BB, labels={"rollbox.backend": "fncall"}),
                               "t", share="reserved")
    with pytest.raises(errors.BadRequest):
        await edge.pause(worker.id, keep_memory=False)
    assert (await edge.get(worker.id)).state == "running"
    mem = await edge.create(SandboxSpec(image=BB, disk_tier="memory"), "t")
    with pytest.raises(errors.BadRequest, match="memory"):
        await edge.pause(mem.id, keep_memory=False)
    assert (await edge.get(mem.id)).state == "running"
    # the contract says which backends can (the edge answers not_supported for the others)
    caps = (await edge.capacity())["backends"]
    assert caps["container"]["fs_pause"] is True
    assert caps.get("vm", {"fs_pause": True})["fs_pause"] is True  # test_pause_fs_vm.py
    # the lifecycle option needs on_expiry "pause"
    with pytest.raises(Exception, match="pause_keep_memory"):
        SandboxSpec(image=BB, pause_keep_memory=False)


async def test_on_expiry_pause_filesystem_only_then_wake(edge: Edge) -> None:
    """on_expiry "pause" with pause_keep_memory=False: the TTL's end stops it; a wake (its
    resume_on_traffic) boots it again with its TTL."""
    sb = await edge.create(SandboxSpec(image=BB, ttl_s=600, on_expiry="pause",
                                       pause_keep_memory=False, resume_on_traffic=True), "t")
    await _run(edge, sb.id, "echo before > /root/f")
    await edge.set_ttl(sb.id, 0.5)
    for _ in range(100):
        info = await edge.get(sb.id)
        if info.state == "paused":
            break
        await asyncio.sleep(0.1)
    assert info.state == "paused" and info.memory_kept is False
    assert not edge.live[sb.id].box.v2_cgroup.exists()
    info = await edge.wake(sb.id)
    assert info.state == "running" and info.expires_at > time.time() + 500
    assert (await _run(edge, sb.id, "cat /root/f"))[1] == "before\n"


async def test_restart_keeps_fs_paused_sandbox(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    sb = await e1.create(SandboxSpec(image=BB), "t")
    await _run(e1, sb.id, "echo across > /root/f")
    boot1 = await _boot_id(e1, sb.id)
    await e1.pause(sb.id, keep_memory=False)
    await restarts.stop()

    e2 = await restarts.start()
    info = await e2.get(sb.id)
    assert info.state == "paused" and info.memory_kept is False
    assert await e2.file_read(sb.id, "/root/f", 64) == b"across\n"
    held = e2.admission.total.memory_mib
    assert e2.live[sb.id].ticket.fds == PAUSED_FS_FDS  # re-adopted as it is: no channel
    await e2.resume(sb.id)
    assert e2.live[sb.id].ticket.fds == box_fds(e2, networked=False)
    assert e2.admission.total.memory_mib == held + sb.resources.memory_mib
    assert (await _run(e2, sb.id, "cat /root/f"))[1] == "across\n"
    assert await _boot_id(e2, sb.id) != boot1
    await e2.pause(sb.id, keep_memory=False)
    await e2.delete(sb.id)
    assert e2.leftovers(sb.id) == []


@BOTH_TRANSPORTS  # the remote edge's wire carries keep_memory too
async def test_fs_pause_through_api_and_sdk(edge, api_edge, tmp_path) -> None:  # noqa: ANN001
    import rollbox
    from rollbox.api import BackgroundServer
    from rollbox.iam import KeyStore

    keys = KeyStore(tmp_path / "keys.db")
    key = keys.create("proj")
    app = api_app(api_edge, edge, keys)
    try:
        async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
            sb = await c.create(BB)
            await sb.files.write("/root/f", "x")
            info = await sb.pause(keep_memory=False)
            assert info.state == "paused" and info.memory_kept is False
            assert not edge.live[sb.id].box.v2_cgroup.exists()
            with pytest.raises(rollbox.SandboxPaused):
                await sb.exec("true")
            with pytest.raises(errors.BadRequest):  # an unknown option: typed, nothing done
                await c._t.request("POST", f"/v1/sandboxes/{sb.id}/pause",
                                   json={"keep_memory": False, "hibernate": True})
            assert (await sb.resume()).memory_kept is True
            assert (await sb.exec("cat /root/f")).stdout == "x"
            with pytest.raises(errors.BadRequest):
                await c.create(BB, pause_keep_memory=False)  # needs on_expiry "pause"
            await sb.delete()
            with pytest.raises(errors.SandboxDead):
                await sb.pause(keep_memory=False)
    finally:
        keys.close()


async def test_fork_of_a_stopped_sandbox(edge: Edge) -> None:
    """A filesystem-paused container can be forked (its writable layer is cloned as for a
    frozen one); the children run, the source stays stopped."""
    from rollbox.models import ForkSpec

    src = await edge.create(SandboxSpec(image=BB), "proj")
    await _run(edge, src.id, "echo forked > /root/f")
    await edge.pause(src.id, keep_memory=False)
    res = await edge.fork(src.id, ForkSpec(n=1), "proj")
    (kid,) = res.children
    try:
        assert kid.state == "running" and kid.memory_kept is True
        assert (await _run(edge, kid.id, "cat /root/f"))[1] == "forked\n"
        info = await edge.get(src.id)
        assert info.state == "paused" and info.memory_kept is False
        assert not edge.live[src.id].box.v2_cgroup.exists()
    finally:
        await edge.delete(kid.id)


async def test_backend_without_fs_pause_is_not_supported(edge: Edge, monkeypatch) -> None:  # noqa: ANN001
    """A backend whose capacity says no: not_supported naming it, and the
    sandbox is left running as it was (the edge's check, with the flag turned off here)."""
    import dataclasses

    sb = await edge.create(SandboxSpec(image=BB), "t")
    backend = edge.live[sb.id].backend
    real = backend.capacity
    monkeypatch.setattr(backend, "capacity",
                        lambda: dataclasses.replace(real(), fs_pause=False))
    with pytest.raises(errors.NotSupported, match="container"):
        await edge.pause(sb.id, keep_memory=False)
    monkeypatch.undo()
    assert (await edge.get(sb.id)).state == "running"
    assert (await _run(edge, sb.id, "echo alive"))[1] == "alive\n"
