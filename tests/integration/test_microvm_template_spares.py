"""Spare QEMUs of a template (backends/microvm/spares.py) on real jailed QEMU: a restore takes
a spare (QEMU started ahead under ``-incoming defer``, its RAM faulted in per the template's
page map), which becomes the sandbox (disk and jail dir renamed, cgroups kept under the spare's
name, CPU quota the create's); clones restored into spares are unique like any restore; spares
come back after a claim; a dead spare is never claimed; spares go when their template is
forgotten, at stop, and a crashed edge's spares are removed by the next start; none is started
when host memory has no room. Nothing of a spare is left anywhere."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rollbox.backends.microvm import ram
from rollbox.backends.microvm import template as T
from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from rollbox.isolation import cgroups
from tests.helpers.vm_template import ready_spares, spare_traces, template_spec, vm_backend

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

PROBE = ("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /etc/machine-id; "
         "hostname; python3 -c 'import random; print(random.random())'")


async def sh(vm: MicroVM, cmd: str, timeout_s: float = 60) -> str:
    code, out = await run_shell(vm, cmd, vm.image_env, timeout_s)
    assert code == 0, out
    return out.decode()


def cpu_file(settings: Settings, name: str, file: str) -> Path:
    """A cpu controller file of the cgroup ``name`` (v1 cpu hierarchy or v2)."""
    for h in cgroups.hierarchies():
        if h.name == "cpu" or h.name.startswith("cpu,") or cgroups.is_pure_v2():
            return h / settings.cgroup_parent / name / file
    raise AssertionError("no cpu hierarchy")


def policies(pid: int) -> set[int]:
    """The scheduling policies of a process's threads."""
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def settings_with(settings: Settings, tmp_path: Path, **kw: object) -> Settings:
    return replace(settings, vm_step_log=tmp_path / "steps.jsonl", **kw)  # type: ignore[arg-type]


async def test_a_restore_takes_a_spare_that_becomes_the_sandbox(
        vm_template_node: Settings, tmp_path: Path) -> None:
    settings = settings_with(vm_template_node, tmp_path, vm_template_spares=2)
    spec = template_spec(settings)
    async with vm_backend(settings) as b:
        assert b.templates is not None
        (tpl,) = b.templates.cache.templates()
        first = await b.create(f"{settings.node_id}-s0", spec)  # no spare yet: its own QEMU
        vms = [first]
        try:
            spares = await ready_spares(b, 2)
            facts = b.capacity().facts["template_spares"]
            assert facts["ready"] == 2 and facts["memory_mib"] > 0
            for sp in spares:
                assert sp.id.startswith(T.SPARE_PREFIX) and sp.digest == tpl.digest
                assert (b.run_root / sp.id).is_dir() and sp.id in b.disks.pool.ids()
                assert os.stat(f"/proc/{sp.pid}").st_uid == sp.host_uid  # jailed as its slot
                argv = open(f"/proc/{sp.pid}/cmdline").read().split("\0")
                assert argv[argv.index("-incoming") + 1] == "defer"  # no guest state yet
                assert sp.pid in cgroups.procs(sp.jail.v2)
                idle = cpu_file(settings, sp.id, "cpu.idle")
                assert not idle.exists() or idle.read_text().strip() == "1"  # starts idle
                assert policies(sp.pid) == {os.SCHED_IDLE}
            if not tpl.shared_ram:  # the page map was made at the build and used
                pages = ram.read_page_map(tpl.pages_path, 256 << 20)
                assert pages is not None
                data = sum(bin(x).count("1") for x in pages)
                assert 1000 < data < (256 << 20) // ram.PAGE // 2
                charged = cgroups.memory_bytes(settings.cgroup_parent, spares[0].id) or 0
                assert charged >= data * ram.PAGE  # its data pages are in already
            pids = {sp.pid: sp.id for sp in spares}
            ids = [f"{settings.node_id}-s{i}" for i in (1, 2)]
            # one claim per CPU class: latency leaves the idle class, batch stays in it
            classes = ("latency", "batch")
            pair = await asyncio.gather(*(b.create(i, dataclasses.replace(spec, qos=c))
                                          for i, c in zip(ids, classes)))
            vms += pair
            for vm, cls in zip(pair, classes):
                assert vm.template == tpl.digest and vm.pid in pids
                assert vm.jail.dir == b.run_root / vm.id and vm.id in b.disks.pool.ids()
                assert vm.jail.cgroup_name == pids[vm.pid]  # the spare's cgroups, kept
                assert not (b.run_root / pids[vm.pid]).exists()
                assert (b.usage(vm).memory_bytes or 0) > 0
                idle = cpu_file(settings, vm.jail.cgroup_name, "cpu.idle")
                want = "1" if cls == "batch" else "0"  # the sandbox's class now
                assert not idle.exists() or idle.read_text().strip() == want, cls
                assert policies(vm.pid) == {os.SCHED_IDLE if cls == "batch" else os.SCHED_OTHER}
            lines = [json.loads(x) for x in settings.vm_step_log.read_text().splitlines()]
            steps = {x["id"]: x["steps"] for x in lines}
            assert all("spare_claim" in steps[i] and "jailer_exec" not in steps[i] for i in ids)
            assert "jailer_exec" in steps[first.id]
            # unique like any restore: RNG, machine-id, hostname, Python's seed
            outs = [(await sh(vm, PROBE)).split("\n") for vm in vms]
            for n, what in enumerate(("urandom", "machine-id", "hostname", "random")):
                assert len({o[n] for o in outs}) == 3, f"{what} shared: {[o[n] for o in outs]}"
            # each its own copy of the template's disk as saved
            await sh(pair[0], "echo mine > /root/only-in-a && sync")
            assert "absent" in await sh(pair[1], "test -e /root/only-in-a || echo absent")
            assert "absent" in await sh(first, "test -e /root/only-in-a || echo absent")
            await ready_spares(b, 2)  # started again after the claims
        finally:
            for vm in vms:
                await b.destroy(vm)
        for vm in vms:
            assert b.leftovers(vm.id) == []
        assert not [p for p in cgroups.leftover(settings.cgroup_parent)
                    if p.name in pids.values()]  # the claimed spares' cgroups went too
        left_ids = [sp.id for sp in b.spares.spares()]
    assert spare_traces(b, left_ids + list(pids.values())) == []  # stopped with the backend


async def test_spares_follow_the_cpus_asked_and_dead_or_forgotten_ones_go(
        vm_template_node: Settings, tmp_path: Path) -> None:
    settings = settings_with(vm_template_node, tmp_path)
    spec = template_spec(settings)
    async with vm_backend(settings) as b:
        assert b.templates is not None
        (tpl,) = b.templates.cache.templates()
        await b.destroy(await b.create(f"{settings.node_id}-c0", spec))
        (sp,) = await ready_spares(b, 1)
        half = replace(spec, resources=spec.resources.model_copy(update={"cpus": 0.5}))
        vm = await b.create(f"{settings.node_id}-c1", half)
        try:
            assert vm.pid == sp.pid
            quota = [h / settings.cgroup_parent / vm.jail.cgroup_name / "cpu.cfs_quota_us"
                     for h in cgroups.hierarchies() if h.name.startswith("cpu")]
            v2 = vm.jail.v2 / "cpu.max"
            got = [int(q.read_text()) for q in quota if q.exists()] or \
                [int(v2.read_text().split()[0])]
            assert got and set(got) == {50_000}
        finally:
            await b.destroy(vm)
        # a spare whose QEMU died is not claimed: the create makes its own QEMU
        (dead,) = await ready_spares(b, 1)
        cgroups.kill(dead.jail.v2)
        await cgroups.wait_empty(dead.jail.v2, 10)
        vm = await b.create(f"{settings.node_id}-c2", spec)
        try:
            assert vm.pid != dead.pid and vm.template == tpl.digest
            assert "hi" in await sh(vm, "echo hi")
        finally:
            await b.destroy(vm)
        # a forgotten template's spares stop
        await ready_spares(b, 1)
        b.spares.forget(tpl.digest)
        deadline = time.monotonic() + 30
        while b.spares.spares() or b.host_sandbox_ids(T.SPARE_PREFIX):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert spare_traces(b, [dead.id, sp.id]) == []


async def test_a_crashed_edges_spares_are_removed_by_the_next_start(
        vm_template_node: Settings, tmp_path: Path) -> None:
    settings = settings_with(vm_template_node, tmp_path)
    spec = template_spec(settings)
    crashed = MicroVMBackend(settings, *_parts(settings))
    await crashed.start()
    try:
        await crashed.destroy(await crashed.create(f"{settings.node_id}-x0", spec))
        (sp,) = await ready_spares(crashed, 1)
        assert crashed.spares._task is not None  # the crash: its background work just ends
        crashed.spares._task.cancel()
        await asyncio.wait({crashed.spares._task})
        assert os.path.exists(f"/proc/{sp.pid}")
        async with vm_backend(settings) as b:  # the next edge's backend
            assert b.host_sandbox_ids(T.SPARE_PREFIX) == set()
            assert spare_traces(b, [sp.id]) == []
            assert not os.path.exists(f"/proc/{sp.pid}") or \
                open(f"/proc/{sp.pid}/stat").read().split()[2] in "ZX"
    finally:
        sp_monitor = [s.monitor for s in crashed.spares.spares()]
        for m in sp_monitor:
            m.close()
        crashed.release_node_resources()
        crashed.slots.close()


async def test_no_spare_without_room_above_the_node_reserve(
        vm_template_node: Settings, tmp_path: Path) -> None:
    with open("/proc/meminfo") as f:
        total_mib = next(int(x.split()[1]) >> 10 for x in f if x.startswith("MemTotal:"))
    settings = settings_with(vm_template_node, tmp_path, memory_reserve_mib=total_mib - 1)
    async with vm_backend(settings) as b:
        vm = await b.create(f"{settings.node_id}-r0", template_spec(settings))
        await b.destroy(vm)
        await asyncio.sleep(2.0)
        assert b.spares.spares() == [] and b.host_sandbox_ids(T.SPARE_PREFIX) == set()


def _parts(settings: Settings) -> tuple:  # noqa: ANN401
    from rollbox.backends.container.disk import DiskPool
    from rollbox.images.store import ImageStore
    from rollbox.isolation.userns import UidSlots

    return (UidSlots(settings.uid_base, settings.uid_slots), ImageStore(settings.images_dir),
            DiskPool(settings))



async def cancel_at(b: MicroVMBackend, create: asyncio.Task, step: str) -> None:
    """Cancel ``create`` as it ends the restore step ``step`` (the step clock of its create,
    steps.py): before the next one starts."""
    from rollbox.backends.microvm import steps as S

    lap = S.Steps.lap

    def lap_then_cancel(self: S.Steps, name: str) -> None:
        lap(self, name)
        if name == step:
            create.cancel()

    S.Steps.lap = lap_then_cancel  # type: ignore[method-assign]
    try:
        for _ in range(100000):
            if create.done() or create.cancelling():
                break
            await asyncio.sleep(0.001)
    finally:
        S.Steps.lap = lap  # type: ignore[method-assign]
    if create.done() and not create.cancelled():
        await b.destroy(create.result())
        raise AssertionError(f"the create was done before {step}")


async def test_a_create_cancelled_while_it_restores_into_a_spare_leaves_nothing(
        vm_template_node: Settings, tmp_path: Path) -> None:
    """Cancels a create as it has claimed a spare (disk and jail dir renamed), loaded the state
    into it, and reached its agent: the create ends cancelled, and nothing of the sandbox or of
    the spare it took is left."""
    settings = settings_with(vm_template_node, tmp_path)
    spec = template_spec(settings)
    async with vm_backend(settings) as b:
        await b.destroy(await b.create(f"{settings.node_id}-k0", spec))
        for n, point in enumerate(("spare_claim", "state_load", "agent_connect")):
            (sp,) = await ready_spares(b, 1)
            sid = f"{settings.node_id}-k{n + 1}"
            create = asyncio.ensure_future(b.create(sid, spec))
            await cancel_at(b, create, point)
            with pytest.raises(asyncio.CancelledError):
                await create
            assert b.leftovers(sid) == [], point
            assert not os.path.exists(f"/proc/{sp.pid}") or \
                open(f"/proc/{sp.pid}/stat").read().split()[2] in "ZX"
            assert sp.id not in b.disks.pool.ids() and not (b.run_root / sp.id).exists()
            assert not [p for p in cgroups.leftover(settings.cgroup_parent) if p.name == sp.id]
