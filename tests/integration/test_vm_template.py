"""Machine templates of the ``vm`` backend (``backends/vm/templates.py``) on the layered
busybox:test guest with ``vm_full_templates="all"`` ("disk" templates disk-image guests only:
the desktop's is test_vm_desktop_template, desktop_slow): the first create of a key boots a build VM once, waits for its
screen to settle, keeps its machine and restores it; the second create restores without a
build; each restored VM is its own (hostname, machine-id, disk) and shows the template's
screen. A template whose state QEMU refuses (overwritten with garbage of its size: the host
never parses it) is dropped and the create boots cold. Two boots in all (the build, the cold
fallback); nothing is left."""
from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.platform_work import run_shell
from rollbox.backends.vm import display
from rollbox.backends.vm.backend import VMBackend
from rollbox.backends.vm.templates import TEMPLATE_DISK_PREFIX
from rollbox.config import Settings
from rollbox.images.store import ImageStore
from rollbox.models import Resources
from tests.conftest import node_settings
from tests.helpers.vm_guest import full_vm_marks, full_vm_template_backend

IMAGE = "busybox:test"
pytestmark = full_vm_marks(IMAGE) + [pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VMBackend]:
    async with full_vm_template_backend(node_settings(tmp_path_factory.mktemp("vmtpl"))) as b:
        yield b


def spec() -> ResolvedSpec:
    layers = tuple(ImageStore(Settings().images_dir).resolve(IMAGE).layers)
    return ResolvedSpec(image=IMAGE, layers=layers, env={"PATH": "/bin:/usr/bin"},
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64))


def steps(b: VMBackend) -> dict[str, str]:
    path = b.settings.vm_step_log
    assert path is not None
    lines = path.read_text().splitlines() if path.exists() else []
    return {d["id"]: d["kind"] for d in map(json.loads, lines)}


async def sh(vm: MicroVM, cmd: str) -> str:
    code, out = await run_shell(vm, cmd, vm.image_env, 60)
    assert code == 0, out
    return out.decode()


def templates_on_disk(b: VMBackend) -> tuple[set[str], list[str]]:
    pool = b.disks.pool
    subvols = (sorted(n for n in os.listdir(pool.mnt) if n.startswith(TEMPLATE_DISK_PREFIX))
               if os.path.ismount(pool.mnt) else [])
    return b.machine_templates.store.ids(), subvols


async def test_creates_restore_the_template_of_their_key(backend: VMBackend) -> None:
    b = backend
    node = b.settings.node_id
    made: list[MicroVM] = []
    try:
        a = await b.create(f"{node}-ta", spec())
        made.append(a)
        tids, subvols = templates_on_disk(b)
        assert len(tids) == 1 and subvols == [TEMPLATE_DISK_PREFIX + next(iter(tids))]
        c = await b.create(f"{node}-tb", spec())
        made.append(c)
        kinds = steps(b)
        builds = [i for i, k in kinds.items() if k == "cold"]
        assert len(builds) == 1 and builds[0].startswith("tplb-"), kinds  # one build VM
        assert kinds[a.id] == kinds[c.id] == "restore"
        assert templates_on_disk(b)[0] == tids  # no second build
        outs = [(await sh(vm, "hostname; cat /etc/machine-id; echo mine > /root/f; "
                          "ls /root")).split("\n") for vm in (a, c)]
        assert [o[0] for o in outs] == [a.id, c.id]
        assert outs[0][1] != outs[1][1]
        assert await sh(c, "cat /root/f") == "mine\n"
        await sh(a, "echo only-a > /root/f")
        assert await sh(c, "cat /root/f") == "mine\n"
        shot = await b.display(a).screenshot()
        assert display.png_size(shot) == display.png_size(await b.display(c).screenshot())

        # the saved state is QEMU's to parse: garbage of its size is refused by the jailed
        # QEMU, the template dropped, the create booted cold
        state = b.machine_templates.store.dir_of(next(iter(tids))) / "state"
        size = state.stat().st_size
        state.write_bytes(os.urandom(4096) * (size // 4096) + b"\0" * (size % 4096))
        d = await b.create(f"{node}-tc", spec())
        made.append(d)
        assert steps(b)[d.id] == "cold"
        assert (await sh(d, "echo booted")) == "booted\n"
        assert templates_on_disk(b) == (set(), [])
    finally:
        for vm in made:
            await b.destroy(vm)
    for vm in made:
        assert b.leftovers(vm.id) == []
    assert not [i for i in b.host_sandbox_ids() if i.startswith("tplb-")]

