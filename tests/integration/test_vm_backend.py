"""The full-VM backend (``backends/vm``) with the real guest (``make vmguest``): one q35 VM of
busybox:test for the module (a TCG boot through SeaBIOS is ~3 s of guest time): exec through
the agent, the screen by QMP screendump (a PNG of the VGA console), keys typed through
``input-send-event`` echoed on tty1, pointer actions, typed refusals of bad input (nothing
sent), pause (screenshots and input refused), and a verified teardown."""
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rollbox.backends.base import ResolvedSpec
from rollbox.backends.container.disk import DiskPool
from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.vm import display
from rollbox.backends.vm.backend import VMBackend
from rollbox.config import Settings
from rollbox.errors import BadRequest, SandboxPaused
from rollbox.images.store import ImageStore
from rollbox.isolation.userns import UidSlots
from rollbox.models import ComputerAction, Resources
from tests.conftest import have_image, node_settings
from tests.helpers.vm_guest import agent_run

IMAGE = "busybox:test"
pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
              pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                                 reason="no full-VM guest (make vmguest)"),
              pytest.mark.skipif(not have_image(IMAGE), reason=f"{IMAGE} not built"),
              pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def vm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vmnode")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def booted(vm_dir: Path) -> AsyncIterator[tuple[VMBackend, MicroVM]]:
    settings = node_settings(vm_dir)
    settings.vm_accel = "tcg"
    settings.vm_idle_squeeze_s = 0
    pool = DiskPool(settings)
    backend = VMBackend(settings, UidSlots(settings.uid_base, settings.uid_slots),
                        ImageStore(settings.images_dir), pool)
    layers = tuple(ImageStore(settings.images_dir).resolve(IMAGE).layers)
    spec = ResolvedSpec(image=IMAGE, layers=layers, env={},
                        resources=Resources(cpus=1, memory_mib=256, disk_mib=64))
    sid = f"{settings.node_id}-qvm0"
    vm = None
    try:
        await backend.start()
        vm = await backend.create(sid, spec)
        yield backend, vm
    finally:
        try:
            if vm is not None:
                await backend.destroy(vm)
            left = backend.leftovers(sid)
        finally:
            backend.release_node_resources()
            pool.release()
        assert left == []


async def run(vm: MicroVM, argv: list[str]) -> tuple[int, bytes]:
    return await agent_run(vm, argv, 30_000, path="PATH=/bin:/usr/bin")


async def test_exec_and_the_machine(booted: tuple[VMBackend, MicroVM]) -> None:
    backend, vm = booted
    assert vm.kind == "vm" and vm.guest_reported
    code, out = await run(vm, ["sh", "-c", "echo hi > /f && cat /f && ls /sys/bus/pci/devices "
                               "| wc -l && cat /proc/cmdline"])
    assert code == 0 and out.startswith(b"hi\n"), out
    assert int(out.split(b"\n")[1]) >= 5  # q35's PCI devices (a microVM has no PCI)
    assert b"console=tty1" in out
    u = backend.usage(vm)
    assert u.memory_bytes and u.memory_bytes > 0
    assert backend.capacity().facts["computer_use"] is True


async def _screen(backend: VMBackend, vm: MicroVM) -> bytes:
    shot = await backend.display(vm).screenshot()
    assert shot[:8] == display.PNG_SIGNATURE
    return shot


async def test_screenshot_typing_and_pointer(booted: tuple[VMBackend, MicroVM]) -> None:
    backend, vm = booted
    d = backend.display(vm)
    info = await d.info()
    assert info.width >= 640 and info.height >= 400
    before = await _screen(backend, vm)
    res = await d.act(ComputerAction(action="type", text="echo Rollbox-42\n",
                                     screenshot_hash=True))
    assert res.events == 2 * 16 + 2  # 16 keys down and up, shift down and up around R
    assert res.screenshot_sha256 and len(res.screenshot_sha256) == 64
    # echoed on tty1 (the VGA console) as the guest's kernel takes the keys (the cursor
    # blinks too, so "changed" is all a screenshot can say without decoding it)
    changed = False
    for _ in range(100):
        await asyncio.sleep(0.2)
        if await _screen(backend, vm) != before:
            changed = True
            break
    assert changed
    await asyncio.sleep(1.0)
    if os.environ.get("ROLLBOX_TEST_SHOTS"):  # to look at by eye
        Path(os.environ["ROLLBOX_TEST_SHOTS"]).write_bytes(await _screen(backend, vm))
    for act in (ComputerAction(action="move", x=10, y=10),
                ComputerAction(action="click", x=info.width - 1, y=info.height - 1),
                ComputerAction(action="double_click", x=5, y=5, button="right"),
                ComputerAction(action="drag", x=1, y=1, x2=100, y2=100),
                ComputerAction(action="scroll", x=50, y=50, dy=-2),
                ComputerAction(action="press", keys="ctrl+shift+a")):
        r = await d.act(act)
        assert r.events > 0 and r.display == info


@pytest.mark.parametrize("action, why", [
    (ComputerAction(action="click", x=-1, y=5), "outside"),
    (ComputerAction(action="move", x=5, y=99999 // 10), "outside"),
    (ComputerAction(action="click"), "needs x and y"),
    (ComputerAction(action="drag", x=1, y=1), "drag's end"),
    (ComputerAction(action="press", keys="ctrl+bogus"), "unknown key"),
    (ComputerAction(action="press", keys="a+b"), "at most one key"),
    (ComputerAction(action="type", text="bell\x07"), "can not type"),
    (ComputerAction(action="type", text="é"), "can not type"),
    (ComputerAction(action="type", text="x" * 5000), "at most"),
    (ComputerAction(action="scroll", x=1, y=1), "needs dy"),
])
async def test_bad_input_is_typed_and_sends_nothing(booted: tuple[VMBackend, MicroVM],
                                                    action: ComputerAction, why: str) -> None:
    backend, vm = booted
    with pytest.raises(BadRequest, match=why):
        await backend.display(vm).act(action)


async def test_paused_vm_refuses_screen_and_input(booted: tuple[VMBackend, MicroVM]) -> None:
    backend, vm = booted
    await backend.pause(vm)
    try:
        with pytest.raises(SandboxPaused):
            await backend.display(vm).screenshot()
        with pytest.raises(SandboxPaused):
            await backend.display(vm).act(ComputerAction(action="type", text="x"))
    finally:
        await backend.resume(vm)
    assert (await run(vm, ["true"]))[0] == 0


async def test_vnc_stream_without_a_listening_socket(booted: tuple[VMBackend, MicroVM]) -> None:
    """A live view's stream: QEMU speaks RFB on a socketpair end it got by QMP; its jail dir
    holds only the agent, QMP and console sockets (no VNC socket, and QEMU has no TCP port)."""
    backend, vm = booted
    sock = await backend.display(vm).vnc_client()
    try:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(10):
            hello = await loop.sock_recv(sock, 12)
        assert hello.startswith(b"RFB 003.")
    finally:
        sock.close()
    assert sorted(p.name for p in vm.jail.dir.glob("*.sock")) == [
        "agent.sock", "console.sock", "qmp.sock"]
    tcp = Path(f"/proc/{vm.pid}/net/tcp").read_text().splitlines()[1:]
    assert all(line.split()[3] != "0A" for line in tcp)  # nothing listening (state 0A)
