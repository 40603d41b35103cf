"""``client.create("desktop", backend="vm")`` boots the desktop:1 disk image on the vm backend
with rollbox's kernel, initramfs and agent (issue 16, docs/backends/vm.md "Two kinds of guest"
2), through the api and a real edge (TCG): the screen shows the desktop (the pixel checks of
``test_vm_desktop_image``: 1024x768, mostly the session's colour none of VGA text mode's
palette, the panel), exec runs in the image's root (``/usr/bin/mousepad``), and the agent is
left alone by systemd: in no unit, and still answering after ``systemctl isolate`` of the
default target. A desktop boot: ``desktop_slow`` only."""
from __future__ import annotations

import asyncio
import time

import pytest

import rollbox
from rollbox.desktop.episode import decode_png
from rollbox.images.sources.desktop import DESKTOP_IMAGE, DESKTOP_MODE
from tests.helpers.desktop import desktop_edge_settings
from tests.integration.test_vm_desktop_image import _stats

pytestmark = [pytest.mark.desktop_slow, pytest.mark.root, pytest.mark.timeout(1800)]

BOOT_TIMEOUT_S = 900.0


@pytest.fixture
def edge_settings(desktop_disk) -> dict:  # noqa: ANN001
    return desktop_edge_settings()  # a cold boot


async def test_desktop_on_the_vm_backend(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj")) as client:
        t0 = time.monotonic()
        sb = await client.create("desktop", backend="vm", cpus=2, memory_mib=1024)
        agent_s = time.monotonic() - t0
        try:
            assert sb.info.image == DESKTOP_IMAGE and sb.info.layers == []
            stats: dict[str, float] = {}
            ready_s = None
            while time.monotonic() - t0 < BOOT_TIMEOUT_S:
                img = decode_png(await sb.screenshot())
                if img.size == DESKTOP_MODE:
                    stats = _stats(img.width, img.height, img.tobytes())
                    if stats["background"] > 0.5 and stats["panel"] > 0.2:
                        ready_s = time.monotonic() - t0
                        break
                await asyncio.sleep(2.0)
            assert ready_s is not None, f"no desktop in {BOOT_TIMEOUT_S:.0f} s (last {stats})"
            assert stats["off_palette"] > 0.5, stats
            print(f"create -> agent {agent_s:.1f} s, -> desktop {ready_s:.1f} s (TCG)")
            res = await sb.exec("ls /usr/bin/mousepad && cat /proc/$PPID/cgroup "
                                "&& systemctl get-default")
            assert res.exit_code == 0, res
            lines = res.stdout.splitlines()
            assert lines[0] == "/usr/bin/mousepad"
            # the agent ($PPID): in its own cgroup, not in systemd's init.scope nor any unit
            assert lines[1] == "0::/rollbox-agent", lines
            target = lines[2].strip()
            res = await sb.exec(f"systemctl isolate {target} && echo isolated")
            assert res.exit_code == 0 and "isolated" in res.stdout, res
            await asyncio.sleep(5.0)
            res = await sb.exec("echo still here; cat /proc/$PPID/comm")
            assert res.stdout == "still here\nrollbox-agent\n", res
        finally:
            await sb.delete()
