"""The microVM backend with the real guest (`make guest`: agent as init): commands through the
agent, deflate on demand after a squeeze, pause/resume by QMP and re-adoption by a new backend
(an edge restart: QEMU outlives it). One VM for the whole module (TCG boots are slow)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollbox.agent.protocol import ExecRequest
from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend
from rollbox.config import Settings
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import Resources
from tests.conftest import node_settings
from tests.helpers.vm_guest import agent_run, real_guest_marks

PY = "python:3.11"
pytestmark = real_guest_marks(PY)
PATH = "PATH=/usr/local/bin:/usr/bin:/bin"


def backend_for(settings: Settings, slots: UidSlots, pool: DiskPool) -> MicroVMBackend:
    return MicroVMBackend(settings, slots, ImageStore(settings.images_dir), pool)


async def run(vm: MicroVM, argv: list[str], timeout_ms: int = 60_000,
              backend: MicroVMBackend | None = None) -> tuple[int, bytes]:
    return await agent_run(vm, argv, timeout_ms, backend)


async def test_agent_exec_squeeze_deflate_pause_and_adopt(tmp_node_dir: Path) -> None:
    settings = node_settings(tmp_node_dir)
    settings.vm_accel = "tcg"
    settings.vm_idle_squeeze_s = 2.0
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    backend = backend_for(settings, slots, pool)
    await backend.start()
    layers = tuple(ImageStore(settings.images_dir).resolve(PY).layers)
    spec = ResolvedSpec(image=PY, layers=layers, env={},
                        resources=Resources(cpus=1, memory_mib=512, disk_mib=512))
    vm = await backend.create(f"{settings.node_id}-vmagent", spec)
    try:
        code, out = await run(vm, ["python3", "-c", "import os; print(os.uname().nodename)"])
        assert code == 0 and out.strip()
        # writes land on the VM's own capped disk, not the host's
        code, out = await run(vm, ["sh", "-c", "echo hi > /root/f && cat /root/f && df -m / "
                                   "| tail -1"])
        assert code == 0 and out.startswith(b"hi\n")
        assert int(out.split()[2]) <= 512  # the overlay's size is the writable disk's

        # a command running keeps it from being squeezed however long it runs ...
        await backend.prepare_exec(vm)
        long = await vm.channel.exec(ExecRequest(argv=["sleep", "5"], env=[PATH]))
        await asyncio.sleep(4.0)
        assert not vm.squeezed
        assert (await long.wait()).exit_code == 0
        # idle for vm_idle_squeeze_s with no command running: squeezed, the balloon takes the
        # guest down to its floor ...
        from rollbox.backends.microvm import balloon, qmp

        for _ in range(100):
            if vm.squeezed:
                break
            await asyncio.sleep(0.1)
        assert vm.squeezed
        target = balloon.squeeze_target(512)

        for _ in range(100):
            async with qmp.session(vm.qmp_path) as q:
                actual = await q.query_balloon()
            if actual <= target + (1 << 20):
                break
            await asyncio.sleep(0.1)
        assert actual <= target + (1 << 20) < 200 << 20
        workload = ["python3", "-c", "b = bytearray(200 << 20)\n"
                    "for i in range(0, len(b), 4096): b[i] = 1\n"
                    "print(sum(b[::4096]))"]
        # ... and deflates before the next command (the guest's own deflate-on-oom is only
        # a slow fallback: 1 MiB per OOM): all its memory back, then 200 MiB touched succeeds
        await backend.prepare_exec(vm)
        assert not vm.squeezed
        async with qmp.session(vm.qmp_path) as q:
            assert await q.query_balloon() == 512 << 20
        code, out = await run(vm, workload, backend=backend)
        assert code == 0 and out.strip() == str(200 << 8).encode()

        # pause: the guest stops (the agent can not answer), resume: it answers again
        await backend.pause(vm)
        with pytest.raises(Exception):
            await vm.channel.ping(timeout=1.0)
        await backend.resume(vm)
        await vm.channel.ping(timeout=10.0)

        # an edge restart: this backend lets go, a new one adopts the running QEMU; squeezed
        # since the state was taken (journaled at create), so the adopter must find that out
        state = vm.state()
        await backend.squeeze(vm)
        backend.detach(vm)
        backend2 = backend_for(settings, UidSlots(settings.uid_base, settings.uid_slots), pool)
        await backend2.start()
        adopted = await backend2.adopt(vm.id, spec, state, paused=False)
        assert adopted is not None and adopted.pid == vm.pid
        assert adopted.squeezed  # read off the balloon: the next exec deflates it
        code, out = await run(adopted, ["cat", "/root/f"], backend=backend2)
        assert not adopted.squeezed
        assert (code, out) == (0, b"hi\n")
        backend, vm = backend2, adopted
    finally:
        await backend.destroy(vm)
        assert backend.leftovers(vm.id) == []
        backend.release_node_resources()
        pool.release()


async def test_a_layer_the_guest_can_not_mount_is_an_infra_error_and_torn_down(
        tmp_node_dir: Path) -> None:
    """A layer file with EROFS's magic but a superblock the guest's erofs refuses: the agent
    answers, its BOOT_INFO names the failed mount, the create fails typed, nothing is left."""
    from rollbox.errors import InfraError

    store = ImageStore(tmp_node_dir / "images")
    good = ImageStore(Settings().images_dir).resolve("busybox:test").layers[0]
    data = bytearray(ImageStore(Settings().images_dir).layer_path(good).read_bytes())
    data[1024 + 12] = 30  # blkszbits: 1 GiB blocks
    crafted = tmp_node_dir / "crafted.erofs"
    crafted.write_bytes(bytes(data))
    bad = store.add_layer_file(crafted)
    settings = node_settings(tmp_node_dir)
    settings.vm_accel = "tcg"
    settings.images_root = store.root
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    backend = backend_for(settings, slots, pool)
    await backend.start()
    spec = ResolvedSpec(image="crafted", layers=(bad,), env={},
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64))
    try:
        with pytest.raises(InfraError) as exc:
            await backend.create(f"{settings.node_id}-vmbadlayer", spec)
        assert exc.value.details.get("reason") == "guest_boot"
        assert "erofs" in exc.value.message
        assert backend.leftovers(f"{settings.node_id}-vmbadlayer") == []
    finally:
        backend.release_node_resources()
        pool.release()
