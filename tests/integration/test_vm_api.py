"""Computer use end to end: ``client.create(image, backend="vm")`` through the api, the edge and
a real q35 VM (TCG, busybox:test; one boot): exec, ``screenshot()`` PNG, ``display()``,
``keyboard.type``/``press``, ``mouse.click``/``drag``/``scroll``, every action in the event
log with its time, typed refusals (off-screen, unknown key, a control byte, a container
sandbox, a paused VM, a deleted one), a verified teardown."""
from __future__ import annotations

import json

import pytest

import rollbox
from rollbox.backends.vm import display as vmdisplay
from rollbox.config import Settings
from rollbox.errors import BadRequest, SandboxDead, SandboxPaused
from tests.helpers.vm_guest import real_guest_marks

BB = "busybox:test"
pytestmark = real_guest_marks(BB) + [
    pytest.mark.skipif(not Settings().vm_full_initrd.is_file(),
                       reason="no full-VM guest (make vmguest)")]


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg"}


async def test_computer_use_through_the_sdk(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    cap = (await edge.capacity())["backends"]["vm"]
    assert cap["offered"] and cap["facts"]["computer_use"] is True
    async with rollbox.AsyncClient(url, keys.create("proj")) as client:
        sb = await client.create(BB, backend="vm", memory_mib=256, disk_mib=64)
        ct = await client.create(BB)
        try:
            assert sb.info.backend == "vm" and sb.info.guest_reported
            res = await sb.exec("echo hi; uname -m")
            assert res.exit_code == 0 and res.stdout.startswith("hi\n")
            shot = await sb.screenshot()
            assert shot[:8] == vmdisplay.PNG_SIGNATURE
            d = await sb.display()
            assert (d.width, d.height) == vmdisplay.png_size(shot)
            r = await sb.keyboard.type("echo ok\n", screenshot_hash=True)
            assert r.events == 16 and r.screenshot_sha256
            await sb.keyboard.press("ctrl+l")
            await sb.mouse.click(d.width // 2, d.height // 2)
            await sb.mouse.double_click(1, 1)
            await sb.mouse.drag(0, 0, d.width - 1, d.height - 1)
            await sb.mouse.scroll(10, 10, dy=3)
            await sb.mouse.move(5, 5)
            for bad, why in ((sb.mouse.click(d.width, 0), "outside"),
                             (sb.mouse.move(-5, 0), "outside"),
                             (sb.keyboard.press("ctrl+nosuchkey"), "unknown key"),
                             (sb.keyboard.type("a\x00b"), "can not type")):
                with pytest.raises(BadRequest, match=why):
                    await bad
            with pytest.raises(BadRequest, match="vm"):
                await ct.screenshot()
            with pytest.raises(BadRequest, match="vm"):
                await ct.keyboard.type("x")
            await sb.pause()
            with pytest.raises(SandboxPaused):
                await sb.screenshot()
            with pytest.raises(SandboxPaused):
                await sb.mouse.move(1, 1)
            await sb.resume()
            events = [e for e in await sb.events() if e.kind.startswith("computer.")]
            kinds = [e.kind for e in events]
            assert kinds[:2] == ["computer.screenshot", "computer.type"], kinds
            for k in ("computer.press", "computer.click", "computer.double_click",
                      "computer.drag", "computer.scroll", "computer.move"):
                assert k in kinds
            typed = json.loads(events[1].data)
            assert typed["text"] == "echo ok\n" and typed["ts"] > 0
            assert typed["screenshot_sha256"] == r.screenshot_sha256
            assert sum(k != "computer.screenshot" for k in kinds) == 7  # refused ones: none
            await sb.delete()  # a dead VM's screen and input: typed errors
            for gone in (sb.screenshot(), sb.display(), sb.mouse.click(1, 1)):
                with pytest.raises(SandboxDead):
                    await gone
        finally:
            await ct.delete()
            await sb.delete()
        assert edge.leftovers(sb.id) == []
