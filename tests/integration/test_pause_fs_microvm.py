"""Filesystem-only pause of a microVM: the guest syncs, QEMU ends (its jail and cgroup go,
its memory is released), the rw disk stays; the journal keeps it stopped across an edge
restart; resume boots it cold over the same disk (files kept, a new boot id, no process of
before); delete leaves nothing. Two boots under TCG: microvm_slow."""
from __future__ import annotations

import os

import pytest

from rollbox import errors
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.conftest import have_image

BB = "busybox:test"
pytestmark = [pytest.mark.microvm_slow,
              pytest.mark.skipif(not have_image(BB), reason="busybox:test not built")]


async def run(edge, sid: str, cmd: str):  # noqa: ANN001, ANN201
    return await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd,
                                                                         timeout_s=60)))


async def test_microvm_fs_pause_reboots_across_a_restart(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    cap = (await e1.capacity())["backends"]["microvm"]
    if not cap["offered"]:
        pytest.skip(f"this node offers no microVMs: {cap['reason']}")
    assert cap["fs_pause"] is True
    sb = await e1.create(SandboxSpec(image=BB, backend="microvm", resources=Resources(
        cpus=1, memory_mib=256, disk_mib=64)), "t")
    # written in the guest just before the pause, never synced by the command itself
    r = await run(e1, sb.id, "echo kept > /root/marker; cat /proc/sys/kernel/random/boot_id")
    assert r.exit_code == 0, r.stderr
    boot1 = r.stdout.strip()
    sleeper = await e1.exec_start(sb.id, ExecSpec(cmd="sleep 600"))
    vm = e1.live[sb.id].box
    pid, jail_dir = vm.pid, vm.jail.dir
    mem = e1.admission.total.memory_mib

    info = await e1.pause(sb.id, keep_memory=False)
    assert info.state == "paused" and info.memory_kept is False
    assert not os.path.exists(f"/proc/{pid}") and not jail_dir.exists()  # QEMU gone
    assert e1.admission.total.memory_mib == mem - 256
    with pytest.raises(errors.SandboxPaused):
        await e1.exec_wait(sb.id, sleeper)
    with pytest.raises(errors.SandboxPaused):  # its files are its agent's: none now
        await e1.file_read(sb.id, "/root/marker", 100)
    await restarts.stop()

    e2 = await restarts.start()
    info = await e2.get(sb.id)
    assert info.state == "paused" and info.memory_kept is False
    await e2.resume(sb.id)
    r = await run(e2, sb.id, "cat /root/marker; cat /proc/sys/kernel/random/boot_id; "
                             "ps -o comm | grep sleep | wc -l")
    assert r.exit_code == 0, r.stderr
    marker, boot2, sleeping = r.stdout.split()
    assert marker == "kept" and boot2 != boot1 and sleeping == "0"
    assert await e2.file_read(sb.id, "/root/marker", 100) == b"kept\n"
    await e2.pause(sb.id, keep_memory=False)
    await e2.delete(sb.id)
    assert e2.leftovers(sb.id) == []
