"""The disk tier of the writable layer: a btrfs subvolume of the node's disk pool, capped by a
qgroup. Writes stop at the cap with EDQUOT (never the OOM killer), host-side writes are charged
too, metadata counts (so one sandbox's inodes can not fill the pool), a silently missing cap is
refused, clones share extents, and nothing is left behind (subvolume, qgroup, mount, loop)."""
from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbox.backends.container.disk import CACHE_PREFIX, DiskPool
from rollbox.backends.container.rootfs import TMPFS_MAGIC, Rootfs
from rollbox.errors import DiskFull
from rollbox.errors import BadRequest, InfraError
from rollbox.isolation import btrfs, cgroups, syscalls
from rollbox.edge.edge import Edge
from rollbox.events.store import EventLog
from rollbox.models import ExecSpec, Resources, SandboxSpec
from tests.conftest import held_elsewhere, node_settings

BB = "busybox:test"
MiB = 1 << 20


@pytest.fixture
def pool(tmp_node_dir: Path) -> Iterator[DiskPool]:
    p = DiskPool(node_settings(tmp_node_dir))
    p.size_gib = 4
    yield p
    for name in p.ids():
        p.remove(name)
    assert p.release()
    # Autoclear detaches the device with the unmount, unless a process that unshared its
    # mount namespace meanwhile (another test run's) still holds a copy of the mount.
    deadline = time.monotonic() + 10
    while (devs := btrfs.loop_devices_of(p.image)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(devs) <= held_elsewhere(dict.fromkeys(devs, "")), devs


async def run(edge, sid: str, cmd: str, timeout_s: float = 60):  # noqa: ANN001, ANN201
    eid = await edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=timeout_s))
    return await edge.exec_wait(sid, eid)


def fill(path: Path, chunk: bytes = b"\0" * MiB) -> int:
    """Write ``path`` until the filesystem refuses; returns the bytes written, the errno."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError as exc:
            assert exc.errno in (errno.EDQUOT, errno.ENOSPC), exc
    return n


def test_cap_counts_data_and_metadata_per_subvolume(pool: DiskPool) -> None:
    a = pool.create("a", 8 * MiB)
    assert fill(a / "data") <= 8 * MiB
    b = pool.create("b", 1 * MiB)
    n = 0
    with pytest.raises(OSError) as exc:  # empty files: metadata only, still charged
        while n < 10_000_000:
            os.close(os.open(b / f"f{n}", os.O_CREAT | os.O_WRONLY, 0o644))
            n += 1
    assert exc.value.errno == errno.EDQUOT
    assert 500 < n < MiB // 100, n  # bounded by bytes: ~350 B of metadata per inode
    c = pool.create("c", 64 * MiB)  # the others' exhaustion left the pool usable
    (c / "x").write_bytes(b"y" * MiB)
    assert pool.cap("c") == 64 * MiB
    for name in ("a", "b", "c"):
        assert pool.remove(name) == []
    deadline = time.monotonic() + 10
    while pool.qgroups() and time.monotonic() < deadline:  # the cleaner drops them
        pool.sync()
        time.sleep(0.05)
    assert pool.qgroups() == []


def test_a_subvolume_without_its_cap_is_refused_and_removed(pool: DiskPool) -> None:
    with pool._root() as fd:
        btrfs.subvol_create(fd, "wrong", 1 * MiB)
    with pytest.raises(InfraError, match="not capped"):
        pool._verified("wrong", 2 * MiB)
    assert pool.leftovers("wrong") == []


def test_rootfs_refuses_an_upper_that_is_not_a_subvolume(tmp_node_dir: Path,
                                                          pool: DiskPool) -> None:
    plain = tmp_node_dir / "plain"  # on the host's disk: what a failed bind would leave
    plain.mkdir()
    rootfs = Rootfs(tmp_node_dir / "sb")
    with pytest.raises(InfraError, match="not on its capped subvolume"):
        rootfs.compose([], -1, 0, 16, 1000, subvolume=plain)
    assert not (tmp_node_dir / "sb").exists()
    sub = pool.create("inner", 16 * MiB) / "dir"  # a btrfs dir, but not a subvolume root
    sub.mkdir()
    with pytest.raises(InfraError, match="not on its capped subvolume"):
        rootfs.compose([], -1, 0, 16, 1000, subvolume=sub)


def test_pool_is_remounted_through_its_loop_device(tmp_node_dir: Path, pool: DiskPool) -> None:
    pool.create("keep", 4 * MiB)
    dev = btrfs.loop_devices_of(pool.image)
    assert len(dev) == 1
    other = DiskPool(node_settings(tmp_node_dir))  # e.g. a restarted edge: finds it mounted
    assert other.ids() == {"keep"}
    assert not pool.release()  # a subvolume is left: stays
    assert btrfs.loop_devices_of(pool.image) == dev  # never a second device for one image


async def test_disk_writes_stop_at_the_cap_not_the_oom_killer(edge) -> None:  # noqa: ANN001
    sb = await edge.create(SandboxSpec(image=BB, resources=Resources(
        memory_mib=256, disk_mib=1024)), "t")
    box = edge.live[sb.id].box
    assert syscalls.statfs_type(box.rootfs.rw) == btrfs.BTRFS_SUPER_MAGIC
    r = await run(edge, sb.id, "dd if=/dev/zero of=/big bs=1M count=900 && sync")
    assert r.exit_code == 0 and not r.oom_killed, r
    pool = edge.backend.disk
    used = pool.used_bytes()
    t0 = time.perf_counter()
    clone = await edge.backend.clone_upper(box, f"{sb.id}-clone")
    clone_s = time.perf_counter() - t0
    try:
        assert (clone / "big").stat().st_size == 900 * MiB
        assert pool.used_bytes() - used < 50 * MiB  # extents shared, not copied
        assert clone_s < 2.0, clone_s  # milliseconds here; a copy of 900 MiB takes seconds
    finally:
        assert pool.remove(f"{sb.id}-clone") == []
    r = await run(edge, sb.id, "dd if=/dev/zero of=/more bs=1M count=300")
    assert r.exit_code == 1 and not r.oom_killed and "quota exceeded" in r.stderr.lower(), r
    r = await run(edge, sb.id, "echo alive")
    assert r.stdout == "alive\n"
    assert cgroups.oom_kills(edge.settings.cgroup_parent, sb.id) == 0
    # Host-side writes (file API, grade copies) land in the same subvolume: charged too.
    with pytest.raises(DiskFull):
        await edge.file_write(sb.id, "/upload", b"x" * (200 * MiB), 0o644)
    await edge.delete(sb.id)
    assert edge.leftovers(sb.id) == []
    assert not pool.path(sb.id).exists()


async def test_tiers_and_leftovers(edge) -> None:  # noqa: ANN001
    mem = await edge.create(SandboxSpec(image=BB, disk_tier="memory"), "t")
    assert (await edge.get(mem.id)).disk_tier == "memory"
    assert syscalls.statfs_type(edge.live[mem.id].box.rootfs.rw) == TMPFS_MAGIC
    with pytest.raises(BadRequest):
        await edge.backend.clone_upper(edge.live[mem.id].box, "x")
    with pytest.raises(ValueError):
        SandboxSpec(image=BB, disk_tier="ssd")
    with pytest.raises(BadRequest):
        await edge.backend.create("n-x", [], Resources(), {}, disk_tier="ssd")
    disk = await edge.create(SandboxSpec(image=BB), "t")
    assert disk.disk_tier == "disk"
    await edge.delete(mem.id)
    await edge.delete(disk.id)
    pool = edge.backend.disk
    pool.create(disk.id, MiB)  # a subvolume a failed teardown left
    assert edge.leftovers(disk.id) == [str(pool.path(disk.id))]
    assert disk.id in edge.backend.host_sandbox_ids(edge.node_id)
    assert pool.remove(disk.id) == []
    assert edge.leftovers(disk.id) == []


def test_pool_comes_back_after_a_reboot(tmp_node_dir: Path, pool: DiskPool) -> None:
    sub = pool.create("survivor", 4 * MiB)
    (sub / "f").write_bytes(b"kept")
    os.sync()
    syscalls.umount(pool.mnt)  # what a reboot leaves: the file, nothing mounted
    after = DiskPool(node_settings(tmp_node_dir))  # the next edge's recovery lists it
    assert after.ids() == {"survivor"}
    assert (after.path("survivor") / "f").read_bytes() == b"kept"
    assert after.cap("survivor") == 4 * MiB  # the limit lives in the filesystem
    assert after.remove("survivor") == []
    assert after.release()



def pool_mounted(pool: DiskPool) -> bool:
    return syscalls.statfs_type(pool.mnt) == btrfs.BTRFS_SUPER_MAGIC


def test_only_a_cache_left_does_not_keep_the_pool_mounted(tmp_node_dir: Path,
                                                          pool: DiskPool) -> None:
    """A microVM template's disk is a cache kept in the pool's file: with only such
    subvolumes left the pool is released; a sandbox's subvolume still keeps it mounted."""
    cached = f"{CACHE_PREFIX}0123abcd"
    (pool.create(cached, 8 * MiB) / "rw.img").write_bytes(b"saved guest disk")
    pool.create("n0-live", 4 * MiB)
    assert not pool.release() and pool_mounted(pool)  # a sandbox's: stays (adopt needs it)
    assert pool.remove("n0-live") == []
    assert pool.release() and not pool_mounted(pool)
    after = DiskPool(node_settings(tmp_node_dir))  # the next edge, or a restore: comes back
    assert after.ids() == {cached}
    assert (after.path(cached) / "rw.img").read_bytes() == b"saved guest disk"
    assert after.cap(cached) == 8 * MiB  # its qgroup was kept: a restore's clone gets the cap
    after.clone(cached, "n0-restored")
    assert after.cap("n0-restored") == 8 * MiB
    assert after.remove("n0-restored") == []


async def test_edge_stop_releases_a_pool_holding_only_a_cache(tmp_node_dir: Path) -> None:
    """At edge stop the pool is unmounted though template disks are in it, unless a sandbox
    lives on (its subvolume must still be there for the next edge's adopt)."""
    settings = node_settings(tmp_node_dir)
    settings.disk_pool_gib = 4
    events = EventLog(tmp_node_dir / "events.db")
    cached = f"{CACHE_PREFIX}0123abcd"
    e1 = Edge(settings, events)
    await e1.start()
    pool = e1.backend.disk
    pool.create(cached, 8 * MiB)
    sb = await e1.create(SandboxSpec(image=BB), "t")
    r = await run(e1, sb.id, "echo kept > /state")
    assert r.exit_code == 0, r
    await e1.close(destroy=False)  # the sandbox lives on
    assert pool_mounted(pool)
    e2 = Edge(settings, events)
    await e2.start()
    try:
        r = await run(e2, sb.id, "cat /state")
        assert r.stdout == "kept\n", r  # adopted with its writable layer
        await e2.delete(sb.id)
    finally:
        await e2.close(destroy=True)
    assert not pool_mounted(pool)  # only the cache is left
    after = DiskPool(settings)
    assert after.ids() == {cached}
    assert after.remove(cached) == []
    assert after.release()
    events.close()


def test_pool_on_a_configured_device(tmp_node_dir: Path) -> None:
    # A partition the operator formatted; a loop device stands in for it here.
    part = tmp_node_dir / "partition.img"
    with open(part, "wb") as f:
        f.truncate(1 << 30)
    subprocess.run(["mkfs.btrfs", "-q", "-f", str(part)], check=True, capture_output=True)
    settings = node_settings(tmp_node_dir)
    with btrfs.loop_attached(part) as dev:
        settings.disk_pool_device = Path(dev)
        pool = DiskPool(settings)
        assert pool.exists()  # no file made: the device is the pool
        sub = pool.create("on-device", 2 * MiB)
        assert fill(sub / "f") <= 2 * MiB
        assert not pool.image.exists()
        assert pool.remove("on-device") == []
        assert pool.release()
    deadline = time.monotonic() + 10
    while (devs := btrfs.loop_devices_of(part)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(devs) <= held_elsewhere(dict.fromkeys(devs, "")), devs


def test_pool_file_has_the_configured_size(pool: DiskPool) -> None:
    pool.ensure()
    assert os.stat(pool.image).st_size == 4 << 30  # ROLLBOX_DISK_POOL_GIB (4 here)
    assert os.stat(pool.image).st_blocks * 512 < 64 * MiB  # sparse: only what is used
    assert os.stat(pool.dir).st_mode & 0o777 == 0o700  # sandboxes' data: root only
