"""Filesystem-only pause of a full VM (backend "vm"), on the VGA test guest (busybox:test with
the agent's sh on tty1): what E2B's ``autoPauseMemory=false`` maps to (``on_expiry="pause"``
with ``pause_keep_memory=False``, the TTL's end pausing it) stops the guest after a sync (QMP
``stop`` flushes its disks, QEMU killed, its jail gone, its memory given back), keeps the rw
disk; the screen is refused while it is stopped (SandboxPaused); resume boots the q35 machine
again over the same disk: the files kept, a new boot id, no process of before, the screen
drawn again. Delete leaves nothing. Across an edge restart it stays stopped (microvm_slow).
(The disk image guest's pause: test_vm_disk.py.)"""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollbox import errors
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.helpers.vm_guest import full_vm_marks

BB = "busybox:test"
pytestmark = full_vm_marks(BB)


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg"}


async def run(edge, sid: str, cmd: str):  # noqa: ANN001, ANN201
    return await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd,
                                                                         timeout_s=60)))


async def paused(edge, sid: str, timeout_s: float = 60) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout_s
    while (await edge.get(sid)).state != "paused":
        assert time.monotonic() < end, "the TTL's end did not pause it"
        await asyncio.sleep(0.2)


async def test_vm_fs_pause_stops_and_boots_again(edge) -> None:  # noqa: ANN001
    cap = (await edge.capacity())["backends"]["vm"]
    assert cap["offered"] and cap["fs_pause"] is True, cap
    sb = await edge.create(SandboxSpec(
        image=BB, backend="vm", vm_console="shell", on_expiry="pause",
        pause_keep_memory=False, resources=Resources(cpus=1, memory_mib=256, disk_mib=64)),
        "t")
    sid = sb.id
    try:
        # written just before the pause, never synced by the command itself
        r = await run(edge, sid, "echo kept > /root/marker; cat /proc/sys/kernel/random/boot_id")
        assert r.exit_code == 0, r.stderr
        boot1 = r.stdout.strip()
        sleeper = await edge.exec_start(sid, ExecSpec(cmd="sleep 600"))
        d1 = await edge.display_info(sid)
        vm = edge.live[sid].box
        pid, jail_dir, rw = vm.pid, vm.jail.dir, edge.live[sid].backend.disks.rw_path(sid)
        mem = edge.admission.total.memory_mib

        await edge.set_ttl(sid, 1)  # E2B's autoPauseMemory=false: the TTL's end stops it
        await paused(edge, sid)
        info = await edge.get(sid)
        assert info.memory_kept is False
        assert not os.path.exists(f"/proc/{pid}") and not jail_dir.exists()  # QEMU gone
        assert rw.is_file()  # its disk kept
        assert edge.admission.total.memory_mib == mem - 256
        with pytest.raises(errors.SandboxPaused):
            await edge.exec_wait(sid, sleeper)
        with pytest.raises(errors.SandboxPaused):  # no screen while it is stopped
            await edge.screenshot(sid)

        await edge.resume(sid)
        await edge.set_ttl(sid, 3600)
        r = await run(edge, sid, "cat /root/marker; cat /proc/sys/kernel/random/boot_id; "
                                 "ps -o comm | grep sleep | wc -l")
        assert r.exit_code == 0, r.stderr
        marker, boot2, sleeping = r.stdout.split()
        assert marker == "kept" and boot2 != boot1 and sleeping == "0"
        assert edge.live[sid].box.pid != pid
        d2 = await edge.display_info(sid)  # the q35 machine's screen again
        assert (d2.width, d2.height) == (d1.width, d1.height)

    finally:
        await edge.delete(sid)
    assert edge.leftovers(sid) == []


@pytest.mark.microvm_slow  # two more TCG boots, as test_pause_fs_microvm's restart
async def test_vm_fs_paused_across_an_edge_restart(restarts) -> None:  # noqa: ANN001
    """The journal keeps a filesystem-paused VM stopped across an edge restart (adopted with
    nothing booted); resume on the new edge boots it over its kept disk."""
    restarts.settings.vm_accel = "tcg"
    e1 = await restarts.start()
    sb = await e1.create(SandboxSpec(image=BB, backend="vm", resources=Resources(
        cpus=1, memory_mib=256, disk_mib=64)), "t")
    assert (await run(e1, sb.id, "echo kept > /root/marker")).exit_code == 0
    await e1.pause(sb.id, keep_memory=False)
    await restarts.stop()
    e2 = await restarts.start()
    info = await e2.get(sb.id)
    assert info.state == "paused" and info.memory_kept is False
    assert e2.live[sb.id].box.stopped and e2.live[sb.id].box.pid == 0  # nothing booted
    await e2.resume(sb.id)
    assert (await run(e2, sb.id, "cat /root/marker")).stdout == "kept\n"
    await e2.delete(sb.id)
    assert e2.leftovers(sb.id) == []
