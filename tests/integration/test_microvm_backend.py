"""The microVM backend's plumbing on real QEMU guests: jail, QMP, disks, boot bounds and a
verified teardown. The guest here is a busybox init (tests/helpers/vm_guest.py) that answers
with one READY line, so these tests need no agent; the agent's exec path is covered by the
tests that use the real guest."""
from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm import qemu
from rollbox.backends.microvm.backend import MicroVMBackend
from rollbox.config import REPO_ROOT
from rollbox.errors import BadRequest, InfraError
from rollbox.images.store import ImageStore
from rollbox.isolation import cgroups
from rollbox.isolation.userns import UidSlots
from rollbox.models import Resources
from tests.conftest import have_image, node_settings
from tests.helpers.vm_guest import guest_or_skip, started_guest_backend
from tests.redteam import qemu_jail

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


class ReadyLine:
    """Stands in for the agent's channel: the test guest's READY line, read off the port."""

    def __init__(self, sock: socket.socket, line: str) -> None:
        self.sock, self.line = sock, line

    def close(self) -> None:
        self.sock.close()

    async def boot_info(self) -> SimpleNamespace:  # the agent's BOOT_INFO: no failed step
        return SimpleNamespace(errno=0, error="")


async def read_ready(path: str, timeout: float) -> ReadyLine:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    await loop.sock_connect(sock, path)
    buf = b""

    async def line() -> bytes:
        nonlocal buf
        while b"\n" not in buf:
            chunk = await loop.sock_recv(sock, 4096)
            if not chunk:
                raise InfraError("port closed")
            buf += chunk
        return buf.split(b"\n", 1)[0]

    try:
        data = await asyncio.wait_for(line(), timeout)
    except BaseException:
        sock.close()
        raise
    return ReadyLine(sock, data.decode())


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return guest_or_skip(tmp_path_factory.mktemp("guest"), REPO_ROOT / "build" / "guest")


@pytest.fixture
async def backend(tmp_node_dir: Path, guest: tuple[Path, Path]):  # noqa: ANN201
    async with started_guest_backend(tmp_node_dir, guest, read_ready) as b:
        yield b


def spec(layers: tuple[str, ...] = (), **res: int) -> ResolvedSpec:
    resources = Resources(cpus=1, memory_mib=res.get("memory_mib", 256),
                          disk_mib=res.get("disk_mib", 64))
    return ResolvedSpec(image="test", layers=layers, resources=resources, env={})


async def test_vm_boots_jailed_pauses_and_leaves_nothing(backend: MicroVMBackend) -> None:
    layers: tuple[str, ...] = ()
    if have_image("busybox:test"):
        layers = tuple(ImageStore(backend.settings.images_dir).resolve("busybox:test").layers)
    vm = await backend.create("vmtest-boot", spec(layers))
    try:
        assert vm.kind == "microvm" and vm.guest_reported
        # the guest saw its disks by serial: every layer read-only, then the writable one
        serials = vm.channel.line.split()[1:]
        assert sorted(serials) == sorted([f"layer{i}" for i in range(len(layers))] + ["rw"])
        st = qemu_jail.status(vm.pid)
        uid = str(vm.host_uid)
        assert st["Uid"].split() == [uid] * 4 and st["Gid"].split() == [uid] * 4
        assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0" * 16
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"  # QEMU's -sandbox filter
        assert st["NSpid"].split()[-1] == "1"  # PID 1 of its own pid namespace
        assert st["THP_enabled"] == "0"  # guest RAM in 4 KiB pages (jailer.c)
        for ns in ("mnt", "pid", "net", "ipc", "uts"):
            assert os.readlink(f"/proc/{vm.pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
        # only its own files, at the fixed paths, and nothing of the host's state dirs
        mounts = Path(f"/proc/{vm.pid}/mountinfo").read_text()
        targets = {line.split()[4] for line in mounts.splitlines()}
        assert targets == {"/", "/usr", "/proc", "/dev", qemu.KERNEL, qemu.INITRD, qemu.RW_DISK,
                           *(qemu.layer_path(i) for i in range(len(layers)))}
        # /dev holds only null (no /dev/kvm under TCG)
        assert sorted(os.listdir(f"/proc/{vm.pid}/root/dev")) == ["null"]
        assert vm.pid in cgroups.procs(vm.jail.v2)
        limit = int((cgroups.ROOT / "memory" / backend.settings.cgroup_parent / vm.id
                     / "memory.limit_in_bytes").read_text())
        assert limit == (256 + backend.settings.vm_overhead_mib
                         + backend.settings.vm_tb_size_mib) << 20
        # QMP stop/cont
        await backend.pause(vm)
        assert await backend.status(vm) == "paused"
        await backend.resume(vm)
        assert await backend.status(vm) == "running"
        usage = backend.usage(vm)
        assert usage.memory_bytes and usage.memory_bytes > 10 << 20
        assert backend.leftovers(vm.id)  # it is there while it runs
    finally:
        await backend.destroy(vm)
    assert backend.leftovers(vm.id) == []
    assert not os.path.exists(f"/proc/{vm.pid}")


async def test_guest_that_never_answers_is_an_infra_error_and_torn_down(
        backend: MicroVMBackend) -> None:
    machine = qemu.MachineSpec(cpus=1, memory_mib=256, layers=0, accel="tcg",
                               tsc_khz=qemu.host_tsc_khz(),
                               extra_cmdline=("rollbox.test=silent",))
    with pytest.raises(InfraError, match="did not boot"):
        await backend.create("vmtest-silent", spec(), boot_timeout_s=4, machine=machine)
    assert backend.leftovers("vmtest-silent") == []
    assert backend.slots._used == set()  # the uid slot is free again


async def test_qemu_that_dies_during_boot_ends_the_wait_at_once(
        backend: MicroVMBackend, tmp_path: Path) -> None:
    bad_kernel = tmp_path / "not-a-kernel"
    bad_kernel.write_bytes(b"\0" * 4096)
    backend.settings.vm_kernel = bad_kernel
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(InfraError, match="QEMU exited during boot") as err:
        await backend.create("vmtest-dies", spec(), boot_timeout_s=60)
    assert loop.time() - t0 < 30
    assert "no message" not in str(err.value)  # QEMU's own words, read from its capped log
    assert backend.leftovers("vmtest-dies") == []


async def test_resources_above_the_node_are_refused_before_anything(
        backend: MicroVMBackend) -> None:
    too_many = ResolvedSpec(image="t", layers=(), env={},
                            resources=Resources(cpus=(os.cpu_count() or 1) + 1))
    with pytest.raises(BadRequest, match="CPUs"):
        await backend.create("vmtest-big", too_many)
    huge = ResolvedSpec(image="t", layers=(), env={},
                        resources=Resources(memory_mib=256 * 1024))
    with pytest.raises(BadRequest, match="MiB"):
        await backend.create("vmtest-big", huge)
    memory_tier = ResolvedSpec(image="t", layers=(), env={}, resources=Resources(),
                               disk_tier="memory")
    with pytest.raises(BadRequest):
        await backend.create("vmtest-big", memory_tier)
    assert backend.leftovers("vmtest-big") == []
    assert backend.slots._used == set()


async def test_accelerator_probe_boots_under_kvm_and_caches_its_choice(
        tmp_node_dir: Path) -> None:
    """auto: a probe boot under KVM decides (here /dev/kvm is PVM: the probe guest never
    reaches its agent, so TCG, with the reason); the choice is cached per kernel, initramfs,
    QEMU and /dev/kvm, so the next node start does not boot again."""
    from rollbox.backends.microvm import accel

    settings = node_settings(tmp_node_dir)
    if not settings.vm_initrd.is_file():
        pytest.skip("no guest (make guest)")
    settings.vm_accel = "auto"
    settings.vm_accel_cache = tmp_node_dir / "accel"
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    b = MicroVMBackend(settings, slots, ImageStore(settings.images_dir), pool)
    accel._memo.clear()
    try:
        await b.start()
        assert b.accel is not None
        if accel._kvm_openable() is not None:
            assert b.accel.accel == "tcg" and "no usable KVM" in b.accel.reason
            return
        assert b.accel.probe_s is not None  # a probe boot happened
        assert b.accel.accel in ("kvm", "tcg") and "probe" in b.accel.reason
        assert b.capacity().facts["accel"] == b.accel.accel
        assert [p.suffix for p in settings.vm_accel_cache.iterdir()] == [".json"]
        assert b.host_sandbox_ids() == set()  # the probe VM is gone
        accel._memo.clear()  # a new process: the cache file answers, no boot
        b2 = MicroVMBackend(settings, slots, ImageStore(settings.images_dir), pool)
        created: list[str] = []
        orig = b2.create

        async def no_boot(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            created.append(a[0])
            return await orig(*a, **kw)

        b2.create = no_boot  # type: ignore[method-assign]
        await b2.start()
        assert b2.accel == b.accel and created == []
    finally:
        b.release_node_resources()
        pool.release()
        slots.close()
