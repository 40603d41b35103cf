"""Disk image guests of the full-VM backend (docs/backends/vm.md, "Two kinds of guest", 2): a
tiny VM disk image built here in seconds (raw ext4 from ``mkfs.ext4 -d`` of busybox-static and
an ``/sbin/init`` shell script that leaves a mark and sleeps), in a temp vm-disks root given by
the settings, booted by the backend with the real ``make vmguest`` kernel and agent, twice
from one base: exec runs in the disk's root, the image's init is PID 1 there, files round trip
through the agent, the two sandboxes do not see each other's writes, raw writes over the
guest's root disk leave the base unchanged (sha256), and a teardown leaves nothing (the
overlay goes with the sandbox's subvolume)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.vm import rootdisk
from rollbox.backends.vm.backend import VMBackend
from rollbox.config import Settings
from rollbox.errors import BadRequest, InfraError, NotFound
from rollbox.images.store import ImageStore
from rollbox.images.vmdisk import find_vm_disk, sha256_file, vm_disk_dir
from rollbox.isolation.userns import UidSlots
from rollbox.models import Resources
from tests.conftest import node_settings
from tests.helpers.vm_guest import agent_run

DISK = "tinydisk:1"
DISK_MIB = 24
pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
              pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                                 reason="no full-VM guest (make vmguest)"),
              pytest.mark.asyncio(loop_scope="module")]

INIT = """#!/bin/sh
# the disk image's init: PID 1 after the agent's hand-over, chrooted in this disk's root
echo "$$ $*" > /run-mark/init
mount -t tmpfs -o mode=0755 tmpfs /run
echo started > /run/init-state
while :; do sleep 3600; done
"""


def build_tiny_disk(root: Path, name: str = DISK, init: str = "/sbin/init") -> Path:
    """A VM disk image of busybox-static and INIT under the vm-disks ``root``, as
    ``rollbox.images.vmdisk`` lays them out (disk.img root's 0444, disk.json)."""
    tree = root / "tree"
    for d in ("bin", "sbin", "etc", "proc", "sys", "dev", "run", "run-mark", "root", "tmp"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    busybox = Settings().platform_busybox
    (tree / "bin/busybox").write_bytes(busybox.read_bytes())
    os.chmod(tree / "bin/busybox", 0o755)
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for a in applets:
        if a != "busybox":
            (tree / "bin" / a).symlink_to("busybox")
    (tree / "sbin/init").write_text(INIT)
    os.chmod(tree / "sbin/init", 0o755)
    (tree / "etc/tiny-release").write_text("tiny disk 1\n")
    (tree / "etc/resolv.conf").write_text("")
    out = vm_disk_dir(root, name)
    out.mkdir(parents=True)
    img = out / "disk.img"
    with open(img, "wb") as f:
        f.truncate(DISK_MIB << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "rollbox-root", "-d", str(tree), str(img)],
                   check=True, capture_output=True)
    os.chmod(img, 0o444)
    manifest = {"name": name, "format": "raw", "bytes": img.stat().st_size,
                "sha256": sha256_file(img), "init": init}
    (out / "disk.json").write_text(json.dumps(manifest))
    return img


@pytest.fixture(scope="module")
def vm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vmdisk")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(vm_dir: Path) -> AsyncIterator[tuple[VMBackend, Path]]:
    settings = node_settings(vm_dir)
    settings.vm_accel = "tcg"
    settings.vm_idle_squeeze_s = 0
    settings.vm_disks_root = vm_dir / "vm-disks"
    img = build_tiny_disk(settings.vm_disks_root)
    pool = DiskPool(settings)
    backend = VMBackend(settings, UidSlots(settings.uid_base, settings.uid_slots),
                        ImageStore(settings.images_dir), pool)
    try:
        await backend.start()
        yield backend, img
    finally:
        backend.release_node_resources()
        pool.release()


def disk_spec(name: str = DISK, **kw: object) -> ResolvedSpec:
    return ResolvedSpec(image=name, layers=(), env={}, disk_image=name,
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64), **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(node: tuple[VMBackend, Path]) -> AsyncIterator[tuple[MicroVM, MicroVM]]:
    backend, _ = node
    made: list[MicroVM] = []
    ids = [f"{backend.settings.node_id}-disk{i}" for i in range(2)]
    try:
        for sid in ids:
            made.append(await backend.create(sid, disk_spec()))
        yield made[0], made[1]
    finally:
        left: list[str] = []
        for vm in made:
            await backend.destroy(vm)
        for sid in ids:
            left += backend.leftovers(sid)
        assert left == []
        for sid in ids:  # the overlay went with the sandbox's subvolume
            assert not (backend.disks.pool.path(sid) / rootdisk.OVERLAY_NAME).exists()


async def run(vm: MicroVM, script: str) -> tuple[int, bytes]:
    return await agent_run(vm, ["sh", "-c", script], 30_000, path="PATH=/bin")


async def test_exec_runs_in_the_disk_root_and_init_is_pid_1(
        two: tuple[MicroVM, MicroVM]) -> None:
    a, _ = two
    assert a.kind == "vm" and a.machine.root_disk and a.machine.layers == 0
    code, out = await run(a, "cat /etc/tiny-release; cat /run-mark/init; "
                             "tr '\\0' ' ' < /proc/1/cmdline; echo; cat /proc/cmdline")
    assert code == 0, out
    lines = out.decode().splitlines()
    assert lines[0] == "tiny disk 1"  # this disk's file: the command's root is the disk
    assert lines[1].split()[0] == "1"  # the init script wrote its $$: it was PID 1
    assert "/sbin/init" in lines[2]  # and still is
    assert "rollbox.root=1" in lines[3] and "rollbox.init=/sbin/init" in lines[3]
    # the init's own /run, mounted after the hand-over in its root: the command's root
    code, out = await run(a, "cat /run/init-state")
    assert (code, out) == (0, b"started\n")
    # the agent ($PPID of a command): out of the root cgroup, in none of the image init's
    assert await run(a, "cat /proc/$PPID/cgroup /proc/$PPID/comm") == (
        0, b"0::/rollbox-agent\nrollbox-agent\n")


async def test_files_round_trip(two: tuple[MicroVM, MicroVM]) -> None:
    a, _ = two
    data = os.urandom(100_000)
    await a.files.write("/root/blob", data)
    assert await a.files.read("/root/blob") == data
    code, out = await run(a, "sha256sum /root/blob")
    assert code == 0 and out.split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_two_sandboxes_of_one_base_do_not_share_writes(
        two: tuple[MicroVM, MicroVM]) -> None:
    a, b = two
    assert (await run(a, "echo a-only > /root/mine && sync"))[0] == 0
    assert (await run(b, "echo b-only > /root/mine && sync"))[0] == 0
    assert await run(a, "cat /root/mine") == (0, b"a-only\n")
    assert await run(b, "cat /root/mine") == (0, b"b-only\n")
    code, _ = await run(b, "test -e /root/blob")  # a's file of the test above
    assert code == 1


async def test_raw_writes_over_the_root_disk_leave_the_base_unchanged(
        node: tuple[VMBackend, Path], two: tuple[MicroVM, MicroVM]) -> None:
    """A guest's root writes its root disk's raw device (it owns the guest): what changes is
    its overlay, never the node's base (opened read-only by QEMU, bound read-only, mode
    0444: each would stop it)."""
    _, img = node
    before = sha256_file(img)
    _, b = two
    code, out = await run(b, "d=$(for x in /sys/block/vd*; do "
                             "[ \"$(cat $x/serial)\" = root ] && echo /dev/${x##*/}; done); "
                             "dd if=/dev/urandom of=$d bs=64k count=16 seek=64 conv=fsync "
                             "2>&1; echo dev=$d")
    assert code == 0 and b"dev=/dev/vd" in out, out
    assert sha256_file(img) == before
    st = img.stat()
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o444


async def test_a_fork_child_has_the_disk_as_it_was_and_its_own_overlay(
        node: tuple[VMBackend, Path], two: tuple[MicroVM, MicroVM]) -> None:
    """A fork child of a disk guest (the saved machine restored, ``disk_binds`` with a
    template): a copy-on-write clone of the parent's overlay over the same base, so it sees
    the parent's files as they were and neither sees the other's later writes; its QEMU has
    the base and its own overlay open, nothing else of the node's disks; it is adopted again
    from its journaled state (an edge restart)."""
    backend, img = node
    a, _ = two
    assert (await run(a, "echo before-fork > /root/forked && sync"))[0] == 0
    cid = f"{backend.settings.node_id}-diskfork"
    res = await backend.fork(a, [(cid, disk_spec())], paused=False)
    child = res.children[0]
    try:
        assert child.machine.root_disk == DISK
        assert await run(child, "cat /root/forked; cat /run/init-state") == (
            0, b"before-fork\nstarted\n")  # its disk and the init's tmpfs carried over
        assert (await run(child, "echo child > /root/forked && sync"))[0] == 0
        assert await run(a, "cat /root/forked") == (0, b"before-fork\n")
        assert (await run(a, "echo parent > /root/forked && sync"))[0] == 0
        assert await run(child, "cat /root/forked") == (0, b"child\n")
        fds = [f"/proc/{child.pid}/fd/{fd}" for fd in os.listdir(f"/proc/{child.pid}/fd")]
        disks = {(os.readlink(f), os.stat(f).st_ino) for f in fds
                 if os.readlink(f).endswith((".img", ".qcow2"))}
        overlay = backend.disks.pool.path(cid) / rootdisk.OVERLAY_NAME
        assert disks == {(rootdisk.BASE_IMG, img.stat().st_ino),
                         (rootdisk.ROOT_QCOW2, overlay.stat().st_ino)}, disks
        # an edge restart: the handle dropped, the VM adopted from its journaled state
        state = json.loads(json.dumps(child.state()))  # as the journal keeps it
        backend.detach(child)
        adopted = await backend.adopt(cid, disk_spec(), state, paused=False)
        assert adopted is not None and adopted.machine == child.machine
        child = adopted
        assert await run(child, "cat /root/forked") == (0, b"child\n")
    finally:
        await backend.destroy(child)
    assert backend.leftovers(cid) == []


async def test_a_filesystem_pause_keeps_the_overlay_and_boots_from_it(
        node: tuple[VMBackend, Path]) -> None:
    """pause_fs of a disk image guest: synced, QEMU stopped (its qcow2 flushed) and gone, the
    overlay kept in the sandbox's subvolume (never opened here); resume_fs boots the image
    again over that overlay: what the guest wrote is there, its init is PID 1 again (a new
    boot), the base unchanged; destroy leaves nothing."""
    backend, img = node
    before = sha256_file(img)
    sid = f"{backend.settings.node_id}-diskpause"
    vm = await backend.create(sid, disk_spec())
    try:
        assert backend.fs_pauses()
        code, out = await run(vm, "echo kept > /root/kept; cat /proc/sys/kernel/random/boot_id")
        assert code == 0, out
        pid, jail, overlay = vm.pid, vm.jail, backend.rootdisks.overlay_path(sid)
        await backend.pause_fs(vm)
        assert vm.stopped and not os.path.exists(f"/proc/{pid}") and jail.leftovers() == []
        assert overlay.is_file()  # and only its disk is left of it
        await backend.resume_fs(vm, None)
        assert not vm.stopped and vm.pid != pid and vm.machine.root_disk == DISK
        code, out2 = await run(vm, "cat /root/kept; cat /proc/sys/kernel/random/boot_id; "
                                   "cut -d' ' -f1 /run-mark/init; cat /run/init-state")
        assert code == 0, out2
        kept, boot2, init_pid, state = out2.decode().split()
        assert kept == "kept" and boot2 != out.decode().strip()
        assert (init_pid, state) == ("1", "started")  # the image's init ran again, PID 1
        assert sha256_file(img) == before
    finally:
        await backend.destroy(vm)
    assert backend.leftovers(sid) == []
    assert not overlay.exists()


async def test_bad_disk_images_are_typed_errors(node: tuple[VMBackend, Path],
                                                vm_dir: Path) -> None:
    backend, _ = node
    sid = f"{backend.settings.node_id}-diskbad"
    with pytest.raises(NotFound, match="nope:1"):
        await backend.create(sid, disk_spec("nope:1"))
    with pytest.raises(BadRequest, match="hidden paths"):
        await backend.create(sid, disk_spec(hidden_paths=("/etc",)))
    with pytest.raises(BadRequest, match="takes no layers"):
        await backend.create(sid, ResolvedSpec(
            image=DISK, layers=("sha256-" + "0" * 64,), env={}, disk_image=DISK,
            resources=Resources(cpus=1, memory_mib=256, disk_mib=64)))
    # a manifest whose sha256 is not the disk's: refused before anything is made
    root = backend.settings.vm_disks_root
    assert root is not None
    build_tiny_disk(vm_dir / "badtree", "badsum:1")
    os.rename(vm_disk_dir(vm_dir / "badtree", "badsum:1"), vm_disk_dir(root, "badsum:1"))
    mpath = vm_disk_dir(root, "badsum:1") / "disk.json"
    m = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**m, "sha256": "0" * 64}))
    with pytest.raises(InfraError, match="sha256"):
        await backend.create(sid, disk_spec("badsum:1"))
    mpath.write_text(json.dumps({**m, "init": "/sbin/init quiet rollbox.fullroot=1"}))
    with pytest.raises(InfraError, match="init"):
        await backend.create(sid, disk_spec("badsum:1"))
    assert backend.leftovers(sid) == []
    # the name without its tag is the newest tag; a layered image's name is no disk
    assert find_vm_disk(root, "tinydisk").name == DISK  # type: ignore[union-attr]
    assert find_vm_disk(root, "busybox:test") is None


async def test_the_overlay_is_new_and_names_no_backing(node: tuple[VMBackend, Path],
                                                 vm_dir: Path) -> None:
    """The host makes the overlay (qemu-img create, a new file), with no backing file in its
    header: QEMU gets the base by -blockdev backing=, never by a name a file carries."""
    backend, _ = node
    disk = backend.rootdisks.verified(DISK)
    sid = f"{backend.settings.node_id}-diskovl"
    path = backend.rootdisks.create_overlay(sid, disk, 8 << 20, 12345)
    try:
        head = path.read_bytes()[:32]
        assert head[:4] == b"QFI\xfb"
        assert int.from_bytes(head[8:16], "big") == 0  # backing_file_offset: none
        assert int.from_bytes(head[24:32], "big") == disk.bytes  # virtual size: the base's
        st = path.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (12345, 0o600)
    finally:
        assert backend.disks.remove_rw(sid) == []
    argv = " ".join(rootdisk.blockdev_args())
    assert "backing=base" in argv and "read-only=on" in argv and "serial=root" in argv
