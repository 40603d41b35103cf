"""MicroVM templates on real jailed QEMU guests (the lane guest's kernel, initramfs and agent):
restored VMs come from the session's one template (tests/conftest.py ``vm_template_node``),
are unique before their first command (RNG, machine-id, Python's seed, hostname) and get the
template's disk as saved, each its own copy; a template that fails to load is dropped and
the create boots cold. Heavier runs (more builds) are behind ``microvm_slow``."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import replace

import pytest

from rollbox.backends.microvm import qemu
from rollbox.backends.microvm import template as T
from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from tests.conftest import node_settings
from tests.helpers.vm_template import template_node, template_spec, vm_backend

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


async def sh(vm: MicroVM, cmd: str, timeout_s: float = 60) -> str:
    code, out = await run_shell(vm, cmd, vm.image_env, timeout_s)
    assert code == 0, out
    return out.decode()


def template_dirs(settings: Settings) -> list[str]:
    return sorted(p.name for p in settings.vm_template_dir.iterdir())


async def test_restored_vms_are_unique_and_each_gets_the_disk_as_saved(
        vm_template_node: Settings) -> None:
    settings = vm_template_node
    before = template_dirs(settings)
    assert len(before) == 1
    async with vm_backend(settings) as b:
        spec = template_spec(settings)
        ids = [f"{settings.node_id}-u{i}" for i in range(2)]
        vms = await asyncio.gather(*(b.create(i, spec) for i in ids))
        try:
            assert [vm.template for vm in vms] == before * 2  # restored, not rebuilt
            probe = ("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
                     "cat /etc/machine-id; hostname; "
                     "python3 -c 'import random; print(random.random())'")
            outs = [(await sh(vm, probe)).split("\n") for vm in vms]
            for what, a, b_ in zip(("urandom", "machine-id", "hostname", "random"), *outs):
                assert a and a != b_, f"{what} shared by two restored VMs: {a!r}"
            assert [o[2] for o in outs] == ids
            assert all(len(o[1]) == 32 for o in outs)
            # each has its own copy of the template's disk: a write in one is not in the
            # other, and the next restore starts from the disk as saved again
            await sh(vms[0], "echo mine > /root/only-in-a && sync")
            assert "absent" in await sh(vms[1], "test -e /root/only-in-a || echo absent")
        finally:
            for vm in vms:
                await b.destroy(vm)
        vm = await b.create(f"{settings.node_id}-u2", spec)
        try:
            assert vm.template == before[0]
            assert "absent" in await sh(vm, "test -e /root/only-in-a || echo absent")
        finally:
            await b.destroy(vm)
        for i in [*ids, f"{settings.node_id}-u2"]:
            assert b.leftovers(i) == []
    assert template_dirs(settings) == before


async def test_a_restored_vm_masks_its_own_hidden_paths(vm_template_node: Settings) -> None:
    settings = vm_template_node
    async with vm_backend(settings) as b:
        spec = replace(template_spec(settings), hidden_paths=("/etc/os-release",))
        vm = await b.create(f"{settings.node_id}-hid", spec)
        try:
            assert vm.template
            assert await sh(vm, "wc -c < /etc/os-release") == "0\n"
        finally:
            await b.destroy(vm)


async def test_a_restored_vm_is_adopted_after_an_edge_restart(
        vm_template_node: Settings) -> None:
    settings = vm_template_node
    spec = template_spec(settings)
    sid = f"{settings.node_id}-adopt"
    async with vm_backend(settings) as first:
        vm = await first.create(sid, spec)
        assert vm.template
        await sh(vm, "echo kept > /root/kept")
        state = vm.state()
        first.detach(vm)  # the edge stops; QEMU runs on
    async with vm_backend(settings) as second:
        again = await second.adopt(sid, spec, state, paused=False)
        assert again is not None
        try:
            assert again.template == vm.template  # journaled with the backend's state
            assert (await sh(again, "cat /root/kept; hostname")).split() == ["kept", sid]
        finally:
            await second.destroy(again)
        assert second.leftovers(sid) == []


@pytest.mark.microvm_slow  # a cold boot more
async def test_a_restored_vm_paused_filesystem_only_resumes_with_its_hostname(
        vm_template_node: Settings) -> None:
    """A restored microVM's hostname is the one make_unique gave it (its id); resume_fs boots
    it cold over its disk, where the agent names a guest "sandbox": the backend sets it again
    (MicroVM.hostname), also after an edge restart (journaled)."""
    settings = vm_template_node
    spec = template_spec(settings)
    sid = f"{settings.node_id}-fsp"
    async with vm_backend(settings) as b:
        vm = await b.create(sid, spec)
        try:
            assert vm.template and vm.hostname == sid
            mid = (await sh(vm, "echo kept > /root/kept; cat /etc/machine-id")).strip()
            await b.pause_fs(vm)
            state = json.loads(json.dumps(vm.state()))
            b.detach(vm)
            vm = await b.adopt(sid, spec, state, paused=True)
            assert vm is not None and vm.stopped and vm.hostname == sid
            await b.resume_fs(vm, None)
            assert (await sh(vm, "cat /root/kept; hostname; cat /etc/machine-id")).split() == [
                "kept", sid, mid]
        finally:
            if vm is not None:
                await b.destroy(vm)
        assert b.leftovers(sid) == []


async def test_a_template_that_fails_to_load_is_dropped_and_the_create_boots_cold(
        vm_template_node: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """A copy of the session's template planted under another key (disk 65 MiB) with its
    state cut in half (and its meta saying so, as if it had been saved that way): QEMU
    refuses it, the template is dropped, the create boots cold and works."""
    settings = vm_template_node
    (good_digest,) = template_dirs(settings)
    spec = template_spec(settings, disk_mib=65)
    async with vm_backend(settings) as b:
        assert b.templates is not None
        key = b.templates.key_for(spec, b.machine_for(spec))
        good = settings.vm_template_dir / good_digest
        bad = settings.vm_template_dir / key.digest
        bad.mkdir(mode=0o700)
        state = (good / T.STATE_NAME).read_bytes()
        (bad / T.STATE_NAME).write_bytes(state[:len(state) // 2])
        meta = json.loads((good / T.META_NAME).read_text())
        good_disk, disk_id = meta["disk_id"], b.templates.cache.disk_id_for(key)
        assert good_disk != disk_id
        b.disks.pool.clone(good_disk, disk_id)
        meta.update(key=key.to_json(), state_bytes=len(state) // 2, disk_id=disk_id)
        if meta.get("shared_ram"):  # the RAM file too: the state is what is broken
            shutil.copyfile(good / T.RAM_NAME, bad / T.RAM_NAME)
            (bad / T.RAM_NAME).chmod(0o444)
        (bad / T.META_NAME).write_text(json.dumps(meta))
        b.templates.recover()  # the cache now knows the planted one
        assert key.digest in {t.digest for t in b.templates.cache.templates()}
        sid = f"{settings.node_id}-bad"
        with caplog.at_level(logging.WARNING, logger="rollbox.backends.microvm"):
            vm = await b.create(sid, spec)
        try:
            assert vm.template == ""  # booted cold
            assert "hello" in await sh(vm, "echo hello")
            assert any("failed to load" in r.getMessage() for r in caplog.records)
        finally:
            await b.destroy(vm)
        assert b.leftovers(sid) == []
        assert not bad.exists() and disk_id not in b.disks.pool.ids()
        assert template_dirs(settings) == [good_digest]


def qemu_ram_mapping(pid: int) -> tuple[str, int, str]:
    """(perms of QEMU's mapping of the RAM file, the access mode its fd was opened with, the
    jail mount's options) of a restored VM's QEMU, read from the host's /proc."""
    maps = [line.split() for line in open(f"/proc/{pid}/maps")]
    perms = [m[1] for m in maps if len(m) >= 6 and m[5] == qemu.RAM_FILE]
    fds = [fd for fd in os.listdir(f"/proc/{pid}/fd")
           if os.readlink(f"/proc/{pid}/fd/{fd}") == qemu.RAM_FILE]
    assert len(perms) == 1 and len(fds) == 1, (perms, fds)
    flags = int(open(f"/proc/{pid}/fdinfo/{fds[0]}").read().split("flags:")[1].split()[0], 8)
    mounts = [line.split() for line in open(f"/proc/{pid}/mountinfo")]
    opts = [m[5] for m in mounts if m[4] == qemu.RAM_FILE]
    assert len(opts) == 1, opts
    return perms[0], flags & os.O_ACCMODE, opts[0]


async def test_restored_vms_share_the_templates_ram_read_only_and_copy_on_write(
        vm_template_node: Settings) -> None:
    """With a QEMU that maps a read-only file private (>= 8.2) the template's RAM is a file
    every restore maps copy-on-write: the state holds the devices only, each clone's QEMU
    has the file through a read-only fd, on a read-only mount, as a private mapping; a clone
    that writes most of its RAM and frees it leaves the file as it was."""
    settings = vm_template_node
    async with vm_backend(settings) as b:
        assert b.templates is not None
        (tpl,) = b.templates.cache.templates()
        if not tpl.shared_ram:
            assert not b.templates.shared_ram
            pytest.skip(f"{qemu.version(str(settings.qemu_binary))}: restores copy the RAM "
                        "(no read-only private file mapping before QEMU 8.2)")
        assert b.capacity().facts["template_ram"] == "shared"
        st = os.stat(tpl.ram_path)
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o444)
        assert st.st_size == 256 << 20 and tpl.state_bytes < 4 << 20  # devices only
        before = T.file_digest(tpl.ram_path)
        T._file_digests.clear()
        vm = await b.create(f"{settings.node_id}-ram", template_spec(settings))
        try:
            assert vm.machine.ram == qemu.RAM_CLONE
            perms, mode, mount_opts = qemu_ram_mapping(vm.pid)
            assert perms == "rw-p"                       # private: writes are the clone's
            assert mode == os.O_RDONLY                   # the file opened read-only
            assert mount_opts.split(",")[0] == "ro"      # on a read-only bind in the jail
            assert "free-page-reporting=off" in " ".join(qemu.argv(vm.machine))
            assert await b.squeeze(vm) is None  # QEMU could not discard a clone's RAM
            await sh(vm, "dd if=/dev/zero of=/dev/null bs=160M count=1 2>&1; "
                         "head -c 64M /dev/urandom | md5sum")
        finally:
            await b.destroy(vm)
        assert T.file_digest(tpl.ram_path) == before


async def test_every_part_of_the_key_is_read_from_the_create(
        vm_template_node: Settings) -> None:
    """Resources, layers, disk size and the guest files each change the key (no boot)."""
    settings = vm_template_node
    async with vm_backend(settings) as b:
        assert b.templates is not None
        spec = template_spec(settings)
        base = b.templates.key_for(spec, b.machine_for(spec))
        others = [template_spec(settings, memory_mib=512), template_spec(settings, disk_mib=65),
                  template_spec(settings, image="busybox:test"),
                  replace(spec, resources=spec.resources.model_copy(update={"cpus": 2}))]
        digests = {b.templates.key_for(s, b.machine_for(s)).digest for s in others}
        assert base.digest not in digests and len(digests) == len(others)
        # cpus=0.5 and 1 are both one vCPU: the same guest, the same template
        half = replace(spec, resources=spec.resources.model_copy(update={"cpus": 0.5}))
        assert b.templates.key_for(half, b.machine_for(half)) == base
        assert base.qemu_version.startswith("QEMU emulator version")
        assert "-incoming" not in base.argv


@pytest.mark.microvm_slow
async def test_concurrent_creates_of_a_new_key_build_one_template(
        tmp_node_dir: os.PathLike[str]) -> None:
    with template_node(node_settings(tmp_node_dir)) as settings:  # builds one (warm-up)
        assert len(template_dirs(settings)) == 1
        async with vm_backend(settings) as b:
            spec = template_spec(settings, memory_mib=320)
            ids = [f"{settings.node_id}-c{i}" for i in range(3)]
            vms = await asyncio.gather(*(b.create(i, spec) for i in ids))
            try:
                assert len({vm.template for vm in vms}) == 1 and vms[0].template
                assert len(template_dirs(settings)) == 2
            finally:
                for vm in vms:
                    await b.destroy(vm)


@pytest.mark.microvm_slow
async def test_the_cache_bound_evicts_the_least_recently_used(
        tmp_node_dir: os.PathLike[str]) -> None:
    with template_node(node_settings(tmp_node_dir)) as settings:
        settings.vm_template_max_count = 1
        async with vm_backend(settings) as b:
            first = template_dirs(settings)
            vm = await b.create(f"{settings.node_id}-e0", template_spec(settings, disk_mib=80))
            await b.destroy(vm)
            after = template_dirs(settings)
            assert len(after) == 1 and after != first and vm.template == after[0]


@pytest.mark.microvm_slow
async def test_the_first_creators_hidden_paths_are_not_in_the_template(
        tmp_node_dir: os.PathLike[str]) -> None:
    with template_node(node_settings(tmp_node_dir)) as settings:
        async with vm_backend(settings) as b:
            spec = template_spec(settings, memory_mib=288)  # a key of its own: built here
            first = await b.create(f"{settings.node_id}-h0",
                                   replace(spec, hidden_paths=("/etc/os-release",)))
            try:
                assert first.template
                assert await sh(first, "wc -c < /etc/os-release") == "0\n"
            finally:
                await b.destroy(first)
            second = await b.create(f"{settings.node_id}-h1", spec)
            try:
                assert second.template == first.template
                assert "ID=" in await sh(second, "cat /etc/os-release")
            finally:
                await b.destroy(second)


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg", "vm_templates": True}  # for the edge fixture's test below


@pytest.mark.microvm_slow
async def test_sdk_creates_through_the_edge_restore_one_template(edge, api_server) -> None:  # noqa: ANN001
    import rollbox

    url, keys = api_server
    settings = edge.settings
    vm_backend_ = edge.backends["microvm"]
    try:
        async with rollbox.AsyncClient(url, keys.create("proj")) as client:
            boxes = [await client.create("busybox:test", backend="microvm", memory_mib=256,
                                         disk_mib=64) for _ in range(2)]
            try:
                outs = [(await sb.exec("hostname; cat /etc/machine-id")).stdout.split()
                        for sb in boxes]
                assert [o[0] for o in outs] == [sb.id for sb in boxes]
                assert outs[0][1] != outs[1][1]
            finally:
                for sb in boxes:
                    await sb.delete()
        assert len(template_dirs(settings)) == 1
    finally:
        vm_backend_.templates.cache.clear()  # the pool is released with the edge
