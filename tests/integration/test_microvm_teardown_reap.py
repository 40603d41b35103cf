"""A microVM's teardown hands its uid slot back only once no host process of the slot's uids is
left, zombies included (no VM boot: stand-in processes run as the slot's uid). An empty cgroup
is not enough: a dying QEMU leaves it before it is reaped, and a jailer or QEMU whose pid file
was never written (a create that failed early) is in no list the teardown had."""
from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.backend import MicroVMBackend
from rollbox.backends.microvm.jail import Jail
from rollbox.errors import InfraError
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from tests.conftest import node_settings
from tests.redteam.test_container_resources import host_pids_of_uid as pids_of_uid

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest.fixture
async def backend(tmp_node_dir: Path) -> AsyncIterator[MicroVMBackend]:
    settings = node_settings(tmp_node_dir)
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    b = MicroVMBackend(settings, slots, ImageStore(settings.images_dir), pool)
    yield b  # no start(): nothing here boots
    b.release_node_resources()
    pool.release()
    slots.close()


def free(b: MicroVMBackend, slot: int) -> bool:
    return slot in b.slots._free


async def test_slot_released_only_after_exiting_process_is_reaped(
        backend: MicroVMBackend) -> None:
    slot = backend.slots.acquire()
    uid = backend.slots.host_uid(slot)
    # still exiting when the teardown starts, and a zombie nobody waited for
    exiting = subprocess.Popen(["sleep", "0.5"], user=uid, group=uid)
    zombie = subprocess.Popen(["true"], user=uid, group=uid)
    sid = "fixreap1"
    jail = Jail(backend.run_root, backend.settings.cgroup_parent, sid)
    try:
        await backend.teardown(sid, jail, slot, None)  # the create-failure path: no pid
        # this test's own processes (the uid band is shared with the run's other sandboxes,
        # whose processes the teardown rightly does not wait for)
        left = set(pids_of_uid(uid))
        assert exiting.pid not in left and zombie.pid not in left, left
        assert free(backend, slot)
        assert backend.leftovers(sid) == []
    finally:
        for p in (exiting, zombie):
            p.kill()
            p.wait()


async def test_slot_kept_while_a_process_of_its_uid_lives(backend: MicroVMBackend) -> None:
    slot = backend.slots.acquire()
    uid = backend.slots.host_uid(slot)
    stray = subprocess.Popen(["sleep", "60"], user=uid, group=uid)
    sid = "fixreap2"
    jail = Jail(backend.run_root, backend.settings.cgroup_parent, sid)
    try:
        with pytest.raises(InfraError) as err:
            await backend.teardown(sid, jail, slot, None)
        assert str(stray.pid) in str(err.value.details)
        assert not free(backend, slot)  # not handed to the next sandbox
        assert any(str(stray.pid) in x for x in backend.leftovers(sid))
    finally:
        stray.kill()
        stray.wait()
    await backend.teardown(sid, jail, slot, None)
    assert free(backend, slot)
    assert backend.leftovers(sid) == []
