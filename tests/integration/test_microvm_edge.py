"""A microVM through the edge, as the api reaches it (SandboxSpec.backend="microvm"): the
registry picks the backend, exec results are guest-reported, files go through the agent, pause
is the VM stopped, the journal keeps the backend's state so a restarted edge re-adopts the
running VM, and delete leaves nothing (no QEMU, jail dir, socket, disk or cgroup). One cold
boot: the default tier's share of this file."""
from __future__ import annotations

import time

import pytest

from rollbox.errors import SandboxPaused
from rollbox.models import ExecSpec, GradeSpec, Resources, SandboxSpec, SnapshotSpec
from tests.conftest import have_image

BB = "busybox:test"


async def run(edge, sid: str, cmd, **kw):  # noqa: ANN001, ANN201
    return await edge.exec_wait(sid, await edge.exec_start(sid, ExecSpec(cmd=cmd, **kw)))


@pytest.mark.skipif(not have_image(BB), reason="busybox:test not built")
async def test_microvm_through_the_edge_across_a_restart(restarts) -> None:  # noqa: ANN001
    e1 = await restarts.start()
    cap = (await e1.capacity())["backends"]["microvm"]
    if not cap["offered"]:
        pytest.skip(f"this node offers no microVMs: {cap['reason']}")
    sb = await e1.create(SandboxSpec(image=BB, backend="microvm", resources=Resources(
        cpus=1, memory_mib=256, disk_mib=64)), "t")
    assert (sb.backend, sb.guest_reported) == ("microvm", True)
    r = await run(e1, sb.id, "echo hi; cat /proc/1/comm")
    assert r.exit_code == 0 and r.stdout.startswith("hi\n") and r.guest_reported
    await e1.file_write(sb.id, "/tmp/x", b"kept", 0o644)
    # a file stream in progress when the VM is paused fails at once (its agent stops too)
    assert (await run(e1, sb.id, "truncate -s 64M /tmp/big")).exit_code == 0
    stream = e1.file_read_stream(sb.id, "/tmp/big", 1 << 30)
    assert len(await stream.__anext__()) > 0
    await e1.pause(sb.id)
    t0 = time.monotonic()
    with pytest.raises(SandboxPaused, match="paused during"):
        while True:  # what was buffered before the pause is not handed out either
            await stream.__anext__()
    assert time.monotonic() - t0 < 10
    await stream.aclose()
    with pytest.raises(SandboxPaused):
        await e1.exec_start(sb.id, ExecSpec(cmd=["true"]))
    # files and snapshots are the frozen agent's: refused at once, not after the deadline
    t0 = time.monotonic()
    with pytest.raises(SandboxPaused, match="resume it first"):
        await e1.file_read(sb.id, "/tmp/x", 100)
    with pytest.raises(SandboxPaused):
        await e1.file_write(sb.id, "/tmp/y", b"no", 0o644)
    with pytest.raises(SandboxPaused):
        await e1.snapshot(sb.id, SnapshotSpec(name=f"test/paused-{sb.id}:1"), "t")
    with pytest.raises(SandboxPaused):  # before a grader is spent
        await e1.grade(sb.id, GradeSpec(cmd="true", files=["/tmp/x"]), "t")
    assert time.monotonic() - t0 < 10
    await e1.resume(sb.id)
    assert (await e1.file_read(sb.id, "/tmp/x", 100)) == b"kept"
    state = e1.journal.get(sb.id)[1]
    assert state is not None and state.get("pid")  # the backend's own state, journaled

    await restarts.stop()  # the VM keeps running
    e2 = await restarts.start()
    assert sb.id in e2.live and e2.live[sb.id].box.kind == "microvm"
    assert (await e2.file_read(sb.id, "/tmp/x", 100)) == b"kept"
    r = await run(e2, sb.id, ["cat", "/tmp/x"])
    assert (r.exit_code, r.stdout, r.guest_reported) == (0, "kept", True)
    await e2.delete(sb.id)
    assert e2.leftovers(sb.id) == []
