"""The file API on a real microVM (the platform's busybox run by descriptor by the guest's
agent, every byte back parsed as hostile): the same checks as on containers
(tests/integration/test_agent_files.py), on one VM booted for the module."""
from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from rollbox.agent import protocol as P
from rollbox.agent.files import AgentFiles
from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.backend import MicroVM, MicroVMBackend
from rollbox.config import REPO_ROOT
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import Resources
from tests.conftest import have_image, node_settings
from tests.integration import test_agent_files as checks

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
              pytest.mark.asyncio(loop_scope="module")]
GUEST = REPO_ROOT / "build" / "guest"
HIDDEN = ("/srv/tests", "/etc/group")  # missing from the image / a file of it


async def vm_sh(vm: MicroVM, cmd: str) -> str:
    """``cmd`` under the platform shell in the VM; its stdout (exit 0 asserted)."""
    sess = await vm.channel.exec(P.ExecRequest(
        argv=P.shell_argv(cmd), env=["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], timeout_ms=60_000,
        platform_shell=True))
    out, err = bytearray(), bytearray()
    async for kind, value in sess.events():
        if kind == "stdout":
            out += value
        elif kind == "stderr":
            err += value
        elif kind == "exited":
            assert value.exit_code == 0, (cmd, value, bytes(err))
    return out.decode()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[MicroVM, MicroVMBackend]]:
    if not (GUEST / "manifest.json").exists() or not have_image(checks.BB):
        pytest.skip("no guest (make guest) or no busybox:test image")
    node = tmp_path_factory.mktemp("vmfiles-node")
    node.chmod(0o711)
    settings = node_settings(node)
    settings.vm_accel = "tcg"
    slots = UidSlots(settings.uid_base, settings.uid_slots)
    pool = DiskPool(settings)
    backend = MicroVMBackend(settings, slots, ImageStore(settings.images_dir), pool)
    layers = tuple(ImageStore(settings.images_dir).resolve(checks.BB).layers)
    vm = None
    try:  # a create that fails still releases the pool and slots (its own teardown ran)
        await backend.start()
        vm = await backend.create("vmfiles-files", ResolvedSpec(
            image=checks.BB, layers=layers, env={}, hidden_paths=HIDDEN,
            resources=Resources(cpus=1, memory_mib=256, disk_mib=64)),
            hardened=False)  # the guest's full root plants what the file API meets (devices)
        yield vm, backend
    finally:
        if vm is not None:
            await backend.destroy(vm)
        left = backend.leftovers("vmfiles-files")
        backend.release_node_resources()
        released = pool.release()
        slots.close()
        assert left == [], left
        assert released, "the disk pool stayed mounted"


@pytest.fixture
def box(vm: tuple[MicroVM, MicroVMBackend]) -> checks.Box:
    machine, _ = vm
    assert isinstance(machine.files, AgentFiles)

    async def sh(cmd: str) -> str:
        return await vm_sh(machine, cmd)

    return checks.Box(machine.files, sh)


async def test_ops(box: checks.Box) -> None:
    await checks.check_write_read_stat_list_mkdir_remove(box)


async def test_bad_input(box: checks.Box) -> None:
    await checks.check_bad_input_and_special_files(box)
    await checks.check_paths_stay_in_root(box)


async def test_streams(box: checks.Box) -> None:
    await checks.check_streams_bounded_and_disk_cap(box)


async def test_tar(box: checks.Box) -> None:
    await checks.check_tar_round_trip_and_hostile_members(box)


async def test_xattrs(box: checks.Box) -> None:
    """The agent's rollbox-xattr in the guest: the file metadata E2B's front door stores."""
    await checks.check_xattrs(box)


async def test_hidden_paths(box: checks.Box) -> None:
    """Masked for the sandbox's commands, reached by the file API (the tools' view)."""
    await box.files.write("/srv/tests/test_x.py", b"secret")
    assert await box.sh("cat /etc/group; ls -A /srv/tests") == ""
    assert await box.sh("echo x > /srv/tests/y 2>/dev/null || echo refused") == "refused\n"
    assert b"root:x:0:" in await box.files.read("/etc/group")
    assert await box.files.read("/srv/tests/test_x.py") == b"secret"
    assert [f.name for f in await box.files.list("/srv/tests")] == ["test_x.py"]
