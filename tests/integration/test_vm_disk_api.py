"""A VM disk image end to end: ``client.create("tinydisk", backend="vm")`` through the api, the
edge and a real q35 VM (TCG; the tiny disk of ``test_vm_disk``, built here): the name without
its tag resolves to the disk before the image store, exec runs in the disk's root, files
round trip, the screen answers, typing and a click reach it, pause/resume, the TTL ends it, a network policy's eth0 is set up by the agent
(the image has no DHCP client), and typed refusals: the disk image on the container and
microVM backends (naming it), extra layers, an unknown name. The edge fixture checks the
teardown leaves nothing."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import rollbox
from rollbox.backends.vm import display as vmdisplay
from rollbox.config import Settings
from rollbox.errors import BadRequest, NotFound
from tests.integration.test_vm_disk import DISK, build_tiny_disk

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
              pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                                 reason="no full-VM guest (make vmguest)")]


@pytest.fixture(scope="module")
def disks_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vmdisks") / "vm-disks"
    build_tiny_disk(root)
    return root


@pytest.fixture
def edge_settings(disks_root: Path) -> dict:
    return {"vm_accel": "tcg", "vm_disks_root": disks_root}


async def test_a_disk_image_through_the_sdk(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    async with rollbox.AsyncClient(url, keys.create("proj")) as client:
        for backend in ("container", "microvm"):
            with pytest.raises(BadRequest, match=f"'{DISK}' is a VM disk image.*'{backend}'"):
                await client.create("tinydisk", backend=backend)
        with pytest.raises(NotFound):
            await client.create("nosuchdisk:1", backend="vm")
        with pytest.raises(BadRequest, match="extra layers"):
            await client.create("tinydisk", backend="vm", layers=["busybox:test"])
        sb = await client.create("tinydisk", backend="vm", memory_mib=256, disk_mib=64,
                                 network=["198.51.100.9:80"])
        try:
            assert sb.info.backend == "vm" and sb.info.image == DISK and sb.info.layers == []
            res = await sb.exec("cat /etc/tiny-release; cat /run-mark/init")
            assert res.exit_code == 0, res
            assert res.stdout.splitlines()[0] == "tiny disk 1"
            assert res.stdout.splitlines()[1].split()[0] == "1"  # the image's init is PID 1
            await sb.files.write("/root/note", b"from the host\n")
            assert await sb.files.read("/root/note") == b"from the host\n"
            res = await sb.exec("cat /root/note; ip -4 addr show eth0")
            assert res.exit_code == 0 and res.stdout.startswith("from the host\n"), res
            assert "inet " in res.stdout  # the agent configured eth0 (no DHCP in the image)
            shot = await sb.screenshot()
            assert shot[:8] == vmdisplay.PNG_SIGNATURE
            r = await sb.keyboard.type("echo typed\n")
            assert r.events == 2 * 11
            await sb.mouse.click(1, 1)
            await sb.pause()
            await sb.resume()
            assert (await sb.exec("echo back")).stdout == "back\n"
            # the TTL ends it as any sandbox: deleted, its overlay with it (the edge fixture
            # checks nothing is left)
            await sb.set_ttl(1.0)
            for _ in range(60):
                await asyncio.sleep(0.5)
                if (await sb.refresh()).state not in ("running", "stopping"):
                    break
            assert (await sb.refresh()).state in ("deleted", "dead"), sb.info
        finally:
            await sb.delete()
