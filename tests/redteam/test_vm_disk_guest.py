"""Red team on a disk image guest of the vm backend (docs/backends/vm.md, "Two kinds of guest"
2; F39, F41): the guest's root (the unhardened twin, ``hardened=False``: every capability, what
the image's own init has anyway) against what the host keeps of the disk.

- the base image: raw writes over the whole of every block device the guest has leave the
  node's base byte for byte (sha256), and the guest has no second disk (the base is no device
  of its own);
- qcow2 backing swap: a qcow2 header naming a host file as its backing, written at the start
  of the guest's disk, lands in the overlay's data clusters; the overlay's own header (QEMU's)
  still names no backing file, and after a pause/resume and a fork the QEMUs have open only
  the base and their own overlays (the backing chain is given by -blockdev, never read from
  a header);
- the agent's channel: the agent's virtio port is held open by the agent, so the guest's root
  can not open it to speak the protocol or read the host's frames (EBUSY).

One TCG boot of the tiny disk of ``tests/integration/test_vm_disk.py`` (~15 s)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.vm import rootdisk
from rollbox.config import Settings
from rollbox.images.vmdisk import sha256_file
from rollbox.models import Resources
from tests.integration.test_vm_disk import DISK
# the tiny disk in a temp vm-disks root, the edge's settings pointing at it (fixtures)
from tests.integration.test_vm_disk_api import disks_root, edge_settings  # noqa: F401
from tests.redteam.conftest import Boxes, needs_root, offered_or_skip

pytestmark = [needs_root,
              pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                                 reason="no full-VM guest (make vmguest)")]

# a qcow2 v2 header whose backing file is the host's /etc/shadow (offset 72, 11 bytes)
FAKE_QCOW2 = (b"QFI\xfb" + (2).to_bytes(4, "big") + (72).to_bytes(8, "big")
              + (11).to_bytes(4, "big") + (16).to_bytes(4, "big") + (1 << 30).to_bytes(8, "big")
              + bytes(72 - 32) + b"/etc/shadow")


def qemu_disk_files(pid: int) -> set[tuple[str, int]]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:  # QEMU opens and closes fds of its own while we look (a closed one is no disk)
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("/") and not link.startswith(("/dev/", "/proc/", "/vm/kernel",
                                                              "/vm/initrd")):
                out.add((link, os.stat(f"/proc/{pid}/fd/{fd}").st_ino))
        except FileNotFoundError:
            continue
    return out


async def test_root_of_a_disk_guest_against_the_base_overlay_and_channel(
        edge, disks_root: Path) -> None:  # noqa: ANN001, F811
    await offered_or_skip(edge, "vm")
    boxes = Boxes(edge, asyncio.Lock(), "vm")
    base = disks_root / "tinydisk%3A1" / "disk.img"
    before = sha256_file(base)
    sid = await boxes.make(DISK, hardened=False, memory_mib=256, disk_mib=64)
    box = edge.live[sid].box
    pool = edge.backends["vm"].disks.pool
    overlay = pool.path(sid) / rootdisk.OVERLAY_NAME
    files = {(rootdisk.BASE_IMG, base.stat().st_ino),
             (rootdisk.ROOT_QCOW2, overlay.stat().st_ino)}
    assert qemu_disk_files(box.pid) == files

    # the agent's port: held by the agent, the guest's root can not open it
    r = await boxes.run(sid, ["sh", "-c",
                              "for p in /sys/class/virtio-ports/*; do "
                              "[ \"$(cat $p/name)\" = org.rollbox.agent ] && d=/dev/${p##*/}; "
                              "done; echo port=$d; exec 3<>$d && echo OPENED"])
    assert "port=/dev/vport" in r.stdout and "OPENED" not in r.stdout, r
    assert "busy" in r.stderr.lower(), r

    # every block device: one disk only, overwritten at its start with a qcow2 header naming a
    # host file, and further on with random bytes
    hdr = "".join(f"\\{b:03o}" for b in FAKE_QCOW2)
    r = await boxes.run(sid, ["sh", "-c",
                              "ls /sys/block | grep ^vd; for d in /sys/block/vd*; do "
                              f"printf '{hdr}' | dd of=/dev/${{d##*/}} conv=notrunc,fsync "
                              "2>/dev/null; done; head -c 4 /dev/vda | od -An -tx1"])
    assert r.exit_code == 0, r
    assert r.stdout.splitlines()[0] == "vda" and r.stdout.count("vd") == 1, r.stdout
    assert r.stdout.split()[-4:] == ["51", "46", "49", "fb"], r.stdout  # its own write
    assert sha256_file(base) == before  # the node's base: unchanged
    assert base.stat().st_mode & 0o777 == 0o444
    # the overlay's header is QEMU's: still no backing file (the test reads 16 bytes of it;
    # the platform never does)
    with open(overlay, "rb") as f:
        head = f.read(16)
    assert head[:4] == b"QFI\xfb" and int.from_bytes(head[8:16], "big") == 0

    # reopened after a pause/resume and in a fork child: only the base and own overlays
    await edge.pause(sid)
    await edge.resume(sid)
    assert qemu_disk_files(box.pid) == files
    backend = edge.backends["vm"]
    cid = f"{sid}f"
    spec = ResolvedSpec(image=DISK, layers=(), env={}, disk_image=DISK,
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64))
    res = await backend.fork(box, [(cid, spec)], paused=False)
    child = res.children[0]
    try:
        child_overlay = pool.path(cid) / rootdisk.OVERLAY_NAME
        assert qemu_disk_files(child.pid) == {(rootdisk.BASE_IMG, base.stat().st_ino),
                                              (rootdisk.ROOT_QCOW2,
                                               child_overlay.stat().st_ino)}
    finally:
        await backend.destroy(child)
    assert backend.leftovers(cid) == []
    # then random bytes over the rest of the disk (its filesystem with them)
    await boxes.run(sid, ["sh", "-c", "dd if=/dev/urandom of=/dev/vda bs=64k seek=1 "
                              "conv=notrunc,fsync 2>&1 | tail -1"], timeout_s=120)
    assert sha256_file(base) == before
    assert qemu_disk_files(box.pid) == files
