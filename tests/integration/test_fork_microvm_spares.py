"""A microVM fork's children restored into spare QEMUs (``vm_fork_spares``,
backends/microvm/backend.py ``fork``, spares.py ``claim_like``, disks.py ``fill_rw``) on the
session's one template node: a spare's disk file, opened by its QEMU at start with the
template's content, gets the fork's by FICLONE, and QEMU's own descriptor reads it (checked on
the host through /proc/<qemu>/fd and in the guest with O_DIRECT reads, past the guest's page
cache); a child's writes reach neither the source, another child nor the template; children
beyond the spares start their own QEMU; a spare that fails halfway (its QEMU killed after the
claim, its disk refusing the clone, one dead before the claim) is torn down and that child
restored into a QEMU of its own; no spare is started again until every child answered a
command, and the edge's descriptors the spares hold are what ``node_fds`` counts (measured in
/proc/self/fd); nothing of a spare or a child is left."""
from __future__ import annotations

import array
import hashlib
import asyncio
import fcntl
import json
import os
import secrets
from dataclasses import replace
from pathlib import Path

import pytest

from rollbox.backends.microvm import steps as S
from rollbox.backends.microvm.backend import SPARE_FDS, MicroVM, MicroVMBackend
from rollbox.backends.microvm.disks import RW_NAME
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from rollbox.isolation import cgroups
from tests.helpers.vm_template import ready_spares, spare_traces, template_spec, vm_backend

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

BLOCK = 4096
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


async def sh(vm: MicroVM, cmd: str, timeout_s: float = 60) -> str:
    code, out = await run_shell(vm, cmd, vm.image_env, timeout_s)
    assert code == 0, out
    return out.decode()


def token() -> bytes:
    return secrets.token_hex(8).encode()  # 16 bytes: a block of it is 256 repeats


async def write_block(vm: MicroVM, mark: bytes) -> None:
    """/root/d: one block of ``mark`` repeated, on the disk (synced)."""
    await sh(vm, f"python3 -c \"open('/root/d','w').write('{mark.decode()}'*256)\" && sync")


async def disk_block(vm: MicroVM) -> bytes:
    """/root/d as the VM's disk has it: an O_DIRECT read (the guest's page cache bypassed,
    so QEMU reads its descriptor of rw.img), as its sha256 (hex)."""
    out = await sh(vm, "dd if=/root/d bs=4096 count=1 iflag=direct status=none | sha256sum")
    return out.split()[0].encode()


def block_of(mark: bytes) -> bytes:
    """The sha256 (hex) of the block :func:`write_block` writes."""
    return hashlib.sha256(mark * (BLOCK // len(mark))).hexdigest().encode()


def holds(path: Path | str, mark: bytes) -> bool:
    """Whether the file has a block of ``mark`` (read whole, 4 MiB at a time)."""
    want = mark * (BLOCK // len(mark))
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            if want in chunk:
                return True
    return False


def qemu_rw_fd(b: MicroVMBackend, vm: MicroVM) -> str:
    """QEMU's own descriptor of its disk file (/proc/<pid>/fd/N), checked to be the inode at
    the sandbox's rw.img."""
    for fd in os.listdir(f"/proc/{vm.pid}/fd"):
        link = f"/proc/{vm.pid}/fd/{fd}"
        try:
            if os.readlink(link).endswith("/" + RW_NAME):
                assert os.stat(link).st_ino == os.stat(b.disks.rw_path(vm.id)).st_ino
                return link
        except FileNotFoundError:
            continue
    raise AssertionError(f"QEMU {vm.pid} holds no {RW_NAME}")


HOLD_CHECK_S = 3.0  # a spare's start begins at once when nothing holds it (a TCG host)


async def no_spare_for(b: MicroVMBackend, seconds: float) -> None:
    """Assert that for ``seconds`` no spare is ready, started or torn down."""
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        assert b.spares.held() == 0, "a spare was started before the fork's children answered"
        await asyncio.sleep(0.02)


def spare_steps(settings: Settings) -> dict[str, dict]:
    lines = [json.loads(x) for x in settings.vm_step_log.read_text().splitlines()]
    return {x["id"]: x["steps"] for x in lines}


def fork_settings(settings: Settings, tmp_path: Path, n: int) -> Settings:
    return replace(settings, vm_step_log=tmp_path / "steps.jsonl", vm_template_spares=n,
                   vm_fork_spares=n)


async def test_fork_children_restore_into_spares_with_the_forks_disk(
        vm_template_node: Settings, tmp_path: Path) -> None:
    settings = fork_settings(vm_template_node, tmp_path, 2)
    spec = template_spec(settings)
    async with vm_backend(settings) as b:
        assert b.templates is not None
        (tpl,) = b.templates.cache.templates()
        fds0 = len(os.listdir("/proc/self/fd"))
        src = await b.create(f"{settings.node_id}-ps", spec)
        kids: list[MicroVM] = []
        spare_ids: list[str] = []
        try:
            before, later, child = token(), token(), token()
            await write_block(src, before)
            spares = await ready_spares(b, 2)
            spare_ids = [sp.id for sp in spares]
            # the edge's descriptors the spares hold are counted for admission (node_fds)
            grown = len(os.listdir("/proc/self/fd")) - fds0
            assert b.node_fds() == 2 * SPARE_FDS
            assert 0 < grown <= b.edge_fds(False) + b.node_fds(), grown
            pids = {sp.pid for sp in spares}
            assert b.capacity().facts["template_spares"]["fork"] == 2
            ids = [f"{settings.node_id}-pk{i}" for i in range(3)]
            kids = list((await b.fork(src, [(i, spec) for i in ids], paused=False)).children)
            assert [k.id for k in kids] == ids
            in_spare = [k for k in kids if k.pid in pids]
            own = [k for k in kids if k.pid not in pids]
            assert len(in_spare) == 2 and len(own) == 1  # the third beyond the spares
            steps = spare_steps(settings)
            for k in in_spare:
                assert "disk_fill" in steps[k.id] and "jailer_exec" not in steps[k.id]
            assert "jailer_exec" in steps[own[0].id]
            # no spare is started again while the children have not answered a command
            await no_spare_for(b, HOLD_CHECK_S)
            assert b.node_fds() == 0
            await write_block(src, later)  # the source runs on, its writes its own
            # QEMU's descriptor, opened at the spare's start on the template's disk, reads the
            # fork's content; the template's disk never had it
            for k in in_spare:
                assert holds(qemu_rw_fd(b, k), before), k.id
            assert not holds(b.disks.rw_path(tpl.disk_id), before)
            # in the guest past its page cache: the disk as of the fork, in every child
            for k in kids:
                assert await disk_block(k) == block_of(before), k.id
                assert (await sh(k, "hostname")).strip() == k.id
            # a child's write reaches neither the source, the other children nor the template
            writer = in_spare[0]
            others = [k for k in kids if k is not writer]
            await write_block(writer, child)
            assert await disk_block(writer) == block_of(child)
            for k in others:
                assert await disk_block(k) == block_of(before), k.id
            assert await disk_block(src) == block_of(later)
            for other in (src, *others):
                assert not holds(b.disks.rw_path(other.id), child), other.id
            assert not holds(b.disks.rw_path(tpl.disk_id), child)
            # the claimed spares are refilled (the template was forked: it keeps 2) once
            # every child answered
            await ready_spares(b, 2)
            # the edge holds 3 descriptors per spare (QMP, QEMU's log and pipe), all counted
            # by node_fds (admission's share of the table for no sandbox)
            assert b.node_fds() == 2 * SPARE_FDS
            with_spares = len(os.listdir("/proc/self/fd"))
            await b.spares.stop()
            assert b.node_fds() == 0
            assert with_spares - len(os.listdir("/proc/self/fd")) == 2 * SPARE_FDS
        finally:
            await asyncio.gather(*(b.destroy(v) for v in [src, *kids]), return_exceptions=True)
        for vm in [src, *kids]:
            assert b.leftovers(vm.id) == []
    assert spare_traces(b, spare_ids) == []


async def test_a_spare_that_fails_halfway_is_torn_down_and_its_child_starts_its_own(
        vm_template_node: Settings, tmp_path: Path) -> None:
    """Three ready spares: one's QEMU dies before the fork (never claimed), one's QEMU is
    killed once its child claimed it (the state load fails), one's disk file is immutable (the
    FICLONE is refused). The fork still makes its three children, each with a QEMU of its own,
    and nothing of the spares is left."""
    settings = fork_settings(vm_template_node, tmp_path, 3)
    spec = template_spec(settings)
    async with vm_backend(settings) as b:
        src = await b.create(f"{settings.node_id}-pf", spec)
        kids: list[MicroVM] = []
        spares = []
        ids = [f"{settings.node_id}-pf{i}" for i in range(3)]
        lap = S.Steps.lap
        try:
            mark = token()
            await write_block(src, mark)
            spares = await ready_spares(b, 3)
            dead, killed, refused = spares
            cgroups.kill(dead.jail.v2)
            await cgroups.wait_empty(dead.jail.v2, 10)
            rw = b.disks.rw_path(refused.id)
            fd = os.open(rw, os.O_RDONLY)
            try:
                flags = array.array("l", [0])
                fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags)
                flags[0] |= FS_IMMUTABLE_FL
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
            finally:
                os.close(fd)
            shot: list[int] = []

            def lap_then_kill(self: S.Steps, name: str) -> None:
                lap(self, name)
                if name == "spare_claim" and not shot:  # the first claim: its QEMU killed
                    shot.append(1)
                    cgroups.kill(killed.jail.v2)

            S.Steps.lap = lap_then_kill  # type: ignore[method-assign]
            kids = list((await b.fork(src, [(i, spec) for i in ids], paused=False)).children)
            S.Steps.lap = lap  # type: ignore[method-assign]
            assert shot and [k.id for k in kids] == ids
            assert not {k.pid for k in kids} & {sp.pid for sp in spares}  # all their own
            for k in kids:
                assert await disk_block(k) == block_of(mark), k.id
            for sp in spares:
                assert not os.path.exists(f"/proc/{sp.pid}") or \
                    open(f"/proc/{sp.pid}/stat").read().split()[2] in "ZX"
        finally:
            S.Steps.lap = lap  # type: ignore[method-assign]
            # a failed test must not leave a file no teardown can remove
            for sid in [*ids, *(sp.id for sp in spares)]:
                _unlock(b.disks.rw_path(sid))
            await asyncio.gather(*(b.destroy(v) for v in [src, *kids]), return_exceptions=True)
        for vm in [src, *kids]:
            assert b.leftovers(vm.id) == []
        # the children's cgroups and jails are their own, not a spare's name
        assert all(k.jail.cgroup_name == k.id for k in kids)
    assert spare_traces(b, [sp.id for sp in spares]) == []


def _unlock(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags)
        flags[0] &= ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
    finally:
        os.close(fd)
