"""Filesystem-only pause of a full VM restored from a machine template (``backends/vm/
templates.py``; templates are on by default for disk image guests, ``vm_full_templates="all"``
here so the layered busybox:test guest has one too): the restored VM (its disk a clone of the
template's) is synced, stopped and its QEMU gone, its disk kept; resume boots it cold over
that clone, not over the template: what it wrote is there, its identity (hostname, machine-id)
is the one the restore gave it (a cold boot's guest names itself "sandbox", a disk image's
"(none)": the hostname was lost at the resume before ``MicroVM.hostname``), a new boot, the
screen drawn again; the template is untouched (a later create restores it and sees none of
the paused VM's writes); paused again across an edge restart (adopted stopped from the
journaled state) it resumes with its hostname too; destroy leaves nothing. microvm_slow: a template build, three restores and two cold boots per
guest under TCG."""
from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.vm import display, rootdisk
from rollbox.backends.vm.backend import VMBackend
from rollbox.config import Settings
from rollbox.images.store import ImageStore
from rollbox.images.vmdisk import sha256_file
from rollbox.models import Resources
from tests.conftest import node_settings
from tests.helpers.vm_guest import agent_run, full_vm_marks, full_vm_template_backend
from tests.integration.test_vm_disk import DISK, build_tiny_disk

IMAGE = "busybox:test"
pytestmark = full_vm_marks(IMAGE) + [pytest.mark.microvm_slow,
                                     pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VMBackend]:
    root = tmp_path_factory.mktemp("vmtplpause")
    settings = node_settings(root)
    settings.vm_disks_root = root / "vm-disks"
    build_tiny_disk(settings.vm_disks_root)
    async with full_vm_template_backend(settings) as b:
        yield b


def layered_spec() -> ResolvedSpec:
    layers = tuple(ImageStore(Settings().images_dir).resolve(IMAGE).layers)
    return ResolvedSpec(image=IMAGE, layers=layers, env={"PATH": "/bin:/usr/bin"},
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64))


def disk_spec() -> ResolvedSpec:
    return ResolvedSpec(image=DISK, layers=(), env={}, disk_image=DISK,
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64))


def kinds(b: VMBackend) -> dict[str, str]:
    path = b.settings.vm_step_log
    assert path is not None
    lines = path.read_text().splitlines() if path.exists() else []
    return {d["id"]: d["kind"] for d in map(json.loads, lines)}


async def sh(vm: MicroVM, cmd: str) -> str:
    code, out = await agent_run(vm, ["sh", "-c", cmd], 60_000, path="PATH=/bin:/usr/bin")
    assert code == 0, out
    return out.decode()


def kept_disk(b: VMBackend, vm: MicroVM) -> Path:
    """The file of the VM's own disk: a disk image guest's qcow2 overlay, else the rw disk."""
    return (b.rootdisks.overlay_path(vm.id) if vm.machine.root_disk
            else b.disks.rw_path(vm.id))


@pytest.mark.parametrize("guest", ["layered", "disk"])
async def test_fs_pause_of_a_template_restored_vm_boots_its_own_disk(
        backend: VMBackend, guest: str) -> None:
    b = backend
    spec = layered_spec if guest == "layered" else disk_spec
    node = b.settings.node_id
    made: list[MicroVM] = []
    base = b.rootdisks.resolve(DISK).disk if guest == "disk" else None
    base_sum = sha256_file(base) if base is not None else None
    try:
        vm = await b.create(f"{node}-{guest}p", spec())
        made.append(vm)
        assert kinds(b)[vm.id] == "restore", kinds(b)  # from the template, not booted
        tids = b.machine_templates.store.ids()
        assert len(tids) >= 1
        ident = "hostname; cat /etc/machine-id; cat /proc/sys/kernel/random/boot_id"
        host1, mid1, boot1 = (await sh(vm, "echo mine > /root/kept; " + ident)).split()
        assert host1 == vm.id  # made unique at the restore (not the build VM's)
        shot1 = display.png_size(await b.display(vm).screenshot())
        pid, jail, disk = vm.pid, vm.jail, kept_disk(b, vm)

        await b.pause_fs(vm)
        assert vm.stopped and not os.path.exists(f"/proc/{pid}") and jail.leftovers() == []
        assert disk.is_file()  # its own disk kept, the template's untouched

        await b.resume_fs(vm, None)
        assert not vm.stopped and vm.pid != pid
        host2, mid2, boot2 = (await sh(vm, ident)).split()
        assert (host2, mid2) == (host1, mid1)  # its identity, kept on its disk
        assert boot2 != boot1  # booted again, cold
        assert await sh(vm, "cat /root/kept") == "mine\n"
        assert display.png_size(await b.display(vm).screenshot()) == shot1

        # the template is as it was: a new create restores it without the paused VM's file
        other = await b.create(f"{node}-{guest}q", spec())
        made.append(other)
        assert kinds(b)[other.id] == "restore"
        assert b.machine_templates.store.ids() == tids
        assert await sh(other, "cat /root/kept 2>&1 || echo none") != "mine\n"
        assert (await sh(other, "hostname")).strip() == other.id
        # paused again, across an edge restart (the handle dropped, adopted from its journaled
        # state with nothing booted): the resume still gives it its own hostname
        await b.pause_fs(vm)
        state = json.loads(json.dumps(vm.state()))  # as the journal keeps it
        b.detach(vm)
        adopted = await b.adopt(vm.id, spec(), state, paused=True)
        assert adopted is not None and adopted.stopped
        made[0] = vm = adopted
        await b.resume_fs(vm, None)
        assert (await sh(vm, "cat /root/kept; hostname; cat /etc/machine-id")).split() == [
            "mine", host1, mid1]
        if base is not None:
            assert sha256_file(base) == base_sum
    finally:
        for v in made:
            await b.destroy(v)
    for v in made:
        assert b.leftovers(v.id) == []
    if guest == "disk":
        for v in made:
            assert not (b.disks.pool.path(v.id) / rootdisk.OVERLAY_NAME).exists()
