"""Fork of a microVM (``MicroVMBackend.fork``) on the session's one template node: memory and
processes carried through a saved image (a file in the guest's RAM-only /dev/shm and a
process started before the fork are in every child), each child made unique (hostname,
machine-id, random bytes), the source keeps running and none of its later writes reaches a
child; the fork's saved state and disk go when the children are made, the children's with
them."""
from __future__ import annotations

import asyncio
import os

import pytest

from rollbox.backends.container.disk import FORK_PREFIX
from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from tests.helpers.vm_template import template_spec, vm_backend

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


async def sh(vm: MicroVM, cmd: str, timeout_s: float = 60) -> str:
    code, out = await run_shell(vm, cmd, vm.image_env, timeout_s)
    assert code == 0, out
    return out.decode()


async def test_a_microvm_fork_carries_memory_and_processes(vm_template_node: Settings) -> None:
    settings = vm_template_node
    async with vm_backend(settings) as b:
        assert b.capacity().fork
        spec = template_spec(settings)
        src = await b.create(f"{settings.node_id}-fsrc", spec)
        kids: list[MicroVM] = []
        try:
            await sh(src, "echo in-ram > /dev/shm/m && echo on-disk > /root/d && sync && "
                     "(setsid sleep 4242 </dev/null >/dev/null 2>&1 &)")
            ids = [f"{settings.node_id}-fk{i}" for i in range(2)]
            res = await b.fork(src, [(i, spec) for i in ids], paused=False)
            kids = list(res.children)
            assert [k.id for k in kids] == ids and 0 < res.frozen_s < 30
            await sh(src, "echo later > /root/d")  # the source runs on, its writes its own
            probe = ("cat /dev/shm/m /root/d; cat /proc/[0-9]*/cmdline 2>/dev/null | "
                     "tr '\\0' ' ' | grep -q 'sleep 42''42' && echo proc; "
                     "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1")
            outs = [(await sh(k, probe)).split("\n") for k in kids]
            for out, kid in zip(outs, ids):
                assert out[:4] == ["in-ram", "on-disk", "proc", kid], out
            for what, a, b_ in zip(("machine-id", "urandom"), *(o[4:6] for o in outs)):
                assert a and a != b_, f"{what} shared by two children: {a!r}"
            assert (await sh(src, "cat /root/d")) == "later\n"
            assert not [n for n in os.listdir(b.disks.pool.mnt) if n.startswith(FORK_PREFIX)]
            assert not any((settings.data_dir / "vm-forks").iterdir())
        finally:
            await asyncio.gather(*(b.destroy(v) for v in [src, *kids]), return_exceptions=True)
        for vm in [src, *kids]:
            assert b.leftovers(vm.id) == []


@pytest.mark.parametrize("warm", [True, False])
async def test_a_fork_wider_than_the_cores_warms_each_child_once(
        vm_template_node: Settings, warm: bool) -> None:
    """More children than cores (the restore gate's width): with ``vm_fork_warm`` each child
    ran the platform shell once in a session of its own before the fork returned (its session
    counter one past the source's), without it none did; either way every child answers, is
    its own and leaves nothing behind."""
    settings = vm_template_node
    n = (os.cpu_count() or 1) + 1
    saved = settings.vm_fork_warm
    settings.vm_fork_warm = warm
    try:
        async with vm_backend(settings) as b:
            spec = template_spec(settings)
            src = await b.create(f"{settings.node_id}-fw{int(warm)}", spec)
            kids: list[MicroVM] = []
            try:
                await sh(src, "true")
                base = src.next_session
                ids = [f"{settings.node_id}-fw{int(warm)}k{i}" for i in range(n)]
                kids = list((await b.fork(src, [(i, spec) for i in ids], paused=False)).children)
                assert [k.next_session for k in kids] == [base + int(warm)] * n
                outs = [(await sh(k, "hostname; cat /etc/machine-id")).split("\n")
                        for k in kids]
                assert [o[0] for o in outs] == ids
                assert len({o[1] for o in outs}) == n  # machine-ids differ
            finally:
                await asyncio.gather(*(b.destroy(v) for v in [src, *kids]),
                                     return_exceptions=True)
            for vm in [src, *kids]:
                assert b.leftovers(vm.id) == []
    finally:
        settings.vm_fork_warm = saved
