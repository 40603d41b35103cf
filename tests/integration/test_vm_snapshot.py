"""Machine snapshots of ``vm`` sandboxes through the edge (one TCG boot of busybox:test): the
snapshot is disk + memory (``Backend.save_machine``), its image restores as new ``vm``
sandboxes only. Two restored children each have the source's running process, its RAM-only
file and its disk file, answer exec (the agent's channel reconnected), show the source's screen
(pixels compared, the cursor cell aside) and take keyboard input, have their own hostname,
machine-id, random bytes and a clock set to the host's; none sees another's or the source's
later writes. A fork of the VM is the same save restored into its child. Bad input is typed:
the image as a container or microVM, another memory size, extra layers, exclude, a deleted
sandbox; a paused source is saved and stays paused. Deleting the image removes the
snapshot's state and disk; nothing is left."""
from __future__ import annotations

import asyncio
import os
import secrets
import struct
import time
import zlib

import pytest

from rollbox.backends.container.disk import MACHINE_SNAPSHOT_PREFIX
from rollbox.backends.vm import display as vmdisplay
from rollbox.backends.vm.snapshots import SNAPSHOTS_DIR
from rollbox.errors import BadRequest, NotFound, SandboxDead
from rollbox.models import ComputerAction, ForkSpec, Resources, SandboxSpec, SnapshotSpec
from tests.helpers.vm_guest import full_vm_marks

BB = "busybox:test"
RES = Resources(cpus=1, memory_mib=256, disk_mib=64)
CELL = 8 * 16  # pixels of one console character cell
pytestmark = full_vm_marks(BB)


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg", "vm_idle_squeeze_s": 0}


def pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB/RGBA PNG (QEMU's screendump); a
    test's decoder: the platform never decodes a screenshot."""
    assert png[:8] == vmdisplay.PNG_SIGNATURE
    pos, idat, ihdr = 8, b"", b""
    while pos < len(png):
        (n,), kind = struct.unpack(">I", png[pos:pos + 4]), png[pos + 4:pos + 8]
        body = png[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = body
        elif kind == b"IDAT":
            idat += body
    w, h, depth, ctype = struct.unpack(">IIBB", ihdr[:10])
    assert depth == 8 and ctype in (2, 6), (depth, ctype)
    bpp = 3 if ctype == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line[j] for j in range(stride) if bpp == 3 or j % 4 != 3))
        prev = line
    return w, h, rows


def differing_pixels(a: bytes, b: bytes) -> int:
    wa, ha, ra = pixels(a)
    wb, hb, rb = pixels(b)
    assert (wa, ha) == (wb, hb)
    return sum(x[i:i + 3] != y[i:i + 3] for x, y in zip(ra, rb) if x != y
               for i in range(0, len(x), 3))


def text_lines(a: bytes, b: bytes) -> tuple[int, int]:
    """(text lines of screen ``a`` that ``b`` shows the same, pixel for pixel; text lines
    that differ): lines of the 16-row console font, a line with text = any lit pixel above
    the cursor's underline rows."""
    wa, ha, ra = pixels(a)
    wb, hb, rb = pixels(b)
    assert (wa, ha) == (wb, hb)
    kept = changed = 0
    for top in range(0, ha - 15, 16):
        if ra[top:top + 16] != rb[top:top + 16]:
            changed += 1
        elif any(any(r) for r in ra[top:top + 13]):
            kept += 1
    return kept, changed


async def sh(edge, sid: str, cmd: str) -> str:  # noqa: ANN001
    code, out = await edge.run_shell(sid, cmd, {"PATH": "/bin:/usr/bin"}, 60)
    assert code == 0, out
    return out.decode()


def snapshot_files(edge) -> tuple[list[str], list[str]]:  # noqa: ANN001
    root = edge.settings.data_dir / SNAPSHOTS_DIR
    pool = edge.backends["vm"].disks.pool
    subvols = ([n for n in os.listdir(pool.mnt) if n.startswith(MACHINE_SNAPSHOT_PREFIX)]
               if os.path.ismount(pool.mnt) else [])
    return (sorted(os.listdir(root)) if root.is_dir() else []), subvols


async def test_a_vm_snapshot_restores_running_machines(edge) -> None:  # noqa: ANN001
    tag = secrets.token_hex(4)  # the node's image store is shared by the test run
    one, two = f"proj/vs-one-{tag}:1", f"proj/vs-two-{tag}:1"
    src = await edge.create(SandboxSpec(image=BB, backend="vm", resources=RES), "proj")
    made = [src.id]
    try:
        assert (await edge.capacity())["backends"]["vm"]["snapshot"] == "machine"
        await sh(edge, src.id, "echo in-ram > /dev/shm/m && echo on-disk > /root/d && sync && "
                 "(setsid sleep 4242 </dev/null >/dev/null 2>&1 &)")
        await edge.computer_action(src.id, ComputerAction(action="type", text="echo SNAP-1\n"))
        await asyncio.sleep(2.0)  # drawn
        with pytest.raises(BadRequest, match="exclude"):
            await edge.snapshot(src.id, SnapshotSpec(name=f"proj/vs-bad-{tag}:1",
                                                     exclude=["/tmp"]), "proj")
        shot = await edge.screenshot(src.id)
        res = await edge.snapshot(src.id, SnapshotSpec(name=one), "proj")
        assert res.kind == "machine" and res.layer is None and res.layers == src.layers
        assert res.memory_bytes > 0 and res.size > res.memory_bytes and 0 < res.paused_s < 60
        dirs, subvols = snapshot_files(edge)
        assert len(dirs) == 1 and subvols == [MACHINE_SNAPSHOT_PREFIX + dirs[0]]
        await sh(edge, src.id, "echo later > /root/d")  # the source runs on, its own

        for backend, kw, why in (("container", {}, "restores as a 'vm' sandbox only"),
                                 ("microvm", {}, "restores as a 'vm' sandbox only"),
                                 ("vm", {"layers": [BB]}, "no extra layers"),
                                 ("vm", {"resources": Resources(cpus=1, memory_mib=384,
                                                                disk_mib=64)}, "memory_mib")):
            with pytest.raises(BadRequest, match=why):
                await edge.create(SandboxSpec(image=one, backend=backend,
                                              **{"resources": RES, **kw}), "proj")

        kids = await asyncio.gather(*(edge.create(
            SandboxSpec(image=one, backend="vm", resources=RES), "proj")
            for _ in range(2)))
        made += [k.id for k in kids]
        probe = ("cat /dev/shm/m /root/d; cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' "
                 "| grep -q 'sleep 42''42' && echo proc; hostname; cat /etc/machine-id; "
                 "head -c 16 /dev/urandom | od -An -tx1; date +%s")
        outs = []
        for k in kids:
            out = (await sh(edge, k.id, probe)).split("\n")
            assert out[:4] == ["in-ram", "on-disk", "proc", k.id], out
            assert abs(int(out[6]) - time.time()) < 15, out  # the clock stepped to the host's
            outs.append(out)
        for what, i in (("machine-id", 4), ("urandom", 5)):
            assert outs[0][i] and outs[0][i] != outs[1][i], f"{what} shared: {outs[0][i]}"
        # the screen as saved: every text line the source showed, pixel for pixel (below
        # them, the agent's line about its new host connection and the cursor)
        kshot = await edge.screenshot(kids[0].id)
        kept, changed = text_lines(shot, kshot)
        assert kept >= 3, f"the restored screen lost the source's text ({kept} lines kept)"
        assert changed <= 2, f"the restored screen is not the source's ({changed} lines differ)"
        await edge.computer_action(kids[0].id, ComputerAction(action="type",
                                                              text="echo CHILD-INPUT-2\n"))
        seen = []
        for _ in range(50):
            await asyncio.sleep(0.2)
            seen.append(differing_pixels(kshot, await edge.screenshot(kids[0].id)))
            if seen[-1] > 2 * CELL:  # a dozen glyphs drawn
                break
        else:
            raise AssertionError(f"typing in the restored VM drew nothing: {seen}")
        # writes are each machine's own
        await sh(edge, kids[0].id, "echo kid0 > /root/d; echo kid0 > /dev/shm/m")
        assert await sh(edge, kids[1].id, "cat /root/d /dev/shm/m") == "on-disk\nin-ram\n"
        assert await sh(edge, src.id, "cat /root/d /dev/shm/m") == "later\nin-ram\n"

        # a fork of a vm sandbox: the same save, restored into the child
        fork = await edge.fork(kids[1].id, ForkSpec(n=1), "proj")
        made += [c.id for c in fork.children]
        child = fork.children[0]
        assert child.backend == "vm"
        out = (await sh(edge, child.id, probe)).split("\n")
        assert out[:4] == ["in-ram", "on-disk", "proc", child.id], out

        # a paused source is saved and stays paused
        await edge.pause(src.id)
        res2 = await edge.snapshot(src.id, SnapshotSpec(name=two), "proj")
        assert res2.kind == "machine" and (await edge.get(src.id)).state == "paused"
        assert len(snapshot_files(edge)[0]) == 2
        await edge.resume(src.id)
        assert await sh(edge, src.id, "cat /root/d") == "later\n"
        await edge.image_delete(two, "proj")
        assert snapshot_files(edge) == (dirs, subvols)  # that one's state and disk went
        with pytest.raises(NotFound):
            await edge.create(SandboxSpec(image=two, backend="vm", resources=RES), "proj")
        await edge.delete(src.id)
        with pytest.raises((NotFound, SandboxDead)):
            await edge.snapshot(src.id, SnapshotSpec(name=f"proj/vs-dead-{tag}:1"), "proj")
        await edge.image_delete(one, "proj")
        assert snapshot_files(edge) == ([], [])
    finally:
        for sid in made:
            try:
                await edge.delete(sid)
            except (NotFound, SandboxDead):
                pass
        for name in (one, two):
            try:
                await edge.image_delete(name, "proj")
            except NotFound:
                pass
    for sid in made:
        assert edge.leftovers(sid) == []
